{{/* Names and labels. */}}
{{- define "cachescout.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "cachescout.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "cachescout.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cachescout.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "cachescout.labels" -}}
{{ include "cachescout.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "cachescout.secretName" -}}
{{- default (printf "%s-auth" (include "cachescout.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "cachescout.kvHost" -}}
{{- printf "%s-kv-redis" (include "cachescout.fullname" .) -}}
{{- end -}}

{{- define "cachescout.stateHost" -}}
{{- printf "%s-state-redis" (include "cachescout.fullname" .) -}}
{{- end -}}

{{- define "cachescout.image" -}}
{{- if .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}
{{- end -}}

{{- define "cachescout.redisImage" -}}
{{- include "cachescout.image" .Values.redisImage -}}
{{- end -}}

{{/* Policy-scanner (checkov) checks this chart does not meet, each with its reason. */}}
{{- define "cachescout.checkovSkips" -}}
checkov.io/skip1: CKV_K8S_43=Images are pinned by tag by default; set image.digest to pin them by digest
checkov.io/skip2: CKV_K8S_15=IfNotPresent with pinned images; Always would pull a 10 GB vLLM image on every restart
{{- end -}}

{{/* The Redis ACL rule of CacheScout's replicas (docs/shared_state.md), limited to this release's keys. */}}
{{- define "cachescout.stateAcl" -}}
resetkeys ~cs:{{ "{" }}{{ default .Release.Name .Values.cachescout.sharedState.deployment }}|* resetchannels -@all +evalsha +eval +script|load +client|setname +ping +time +get +set +incr +del +exists +pexpire +hget +hmget +hset +strlen +getrange +rename +persist +type +zadd +zrem +zrange +zrangebyscore
{{- end -}}

{{/* LMCache's Redis commands (redis-py GET/SET/EXISTS on its chunk keys). */}}
{{- define "cachescout.kvAcl" -}}
resetkeys ~* resetchannels -@all +@read +@write +@keyspace +@connection -@dangerous +client|setname +info
{{- end -}}

{{/* redis-cli flags for probes: TLS when enabled; the default user may only PING. */}}
{{- define "cachescout.redisCli" -}}
{{- if .Values.tls.enabled -}}
redis-cli --tls --cacert /tls/ca.crt -p {{ .port }}
{{- else -}}
redis-cli -p {{ .port }}
{{- end -}}
{{- end -}}

{{/* Redis server flags for TLS: the plain port is closed. */}}
{{- define "cachescout.redisTls" -}}
{{- if .Values.tls.enabled }}
port 0
tls-port {{ .port }}
tls-cert-file /tls/tls.crt
tls-key-file /tls/tls.key
tls-ca-cert-file /tls/ca.crt
tls-auth-clients optional
tls-replication yes
{{- else }}
port {{ .port }}
{{- end }}
{{- end -}}

{{- define "cachescout.redisPodSecurity" -}}
runAsNonRoot: true
runAsUser: 10999
runAsGroup: 10999
fsGroup: 10999
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "cachescout.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* The URL CacheScout's shared state uses (or Sentinel settings). */}}
{{- define "cachescout.sharedState" -}}
{{- $s := dict "deployment" (default .Release.Name .Values.cachescout.sharedState.deployment) "flush_interval_s" .Values.cachescout.sharedState.flushIntervalS "username" "cachescout" "password_file" "/secrets/state-password" -}}
{{- $scheme := ternary "rediss" "redis" .Values.tls.enabled -}}
{{- if .Values.stateRedis.sentinel.enabled -}}
{{- $sentinels := list -}}
{{- range $i := until (int .Values.stateRedis.sentinel.replicas) -}}
{{- $sentinels = append $sentinels (printf "%s-sentinel-%d.%s-sentinel:%d" (include "cachescout.stateHost" $) $i (include "cachescout.stateHost" $) (int $.Values.stateRedis.sentinel.port)) -}}
{{- end -}}
{{- $_ := set $s "sentinels" $sentinels -}}
{{- $_ := set $s "sentinel_service" .Values.stateRedis.sentinel.masterName -}}
{{- if .Values.tls.enabled -}}
{{- $_ := set $s "sentinel_tls" true -}}
{{- end -}}
{{- else -}}
{{- $_ := set $s "url" (printf "%s://%s:%d/0" $scheme (include "cachescout.stateHost" .) (int .Values.stateRedis.port)) -}}
{{- end -}}
{{- if .Values.tls.enabled -}}
{{- $_ := set $s "tls_ca_file" "/tls/ca.crt" -}}
{{- end -}}
{{- toJson $s -}}
{{- end -}}

{{/* vLLM's --kv-transfer-config: CacheScoutConnector alone, or beside LMCache's in MultiConnector. */}}
{{- define "cachescout.kvTransferConfig" -}}
{{- $extra := deepCopy .Values.cachescout.settings -}}
{{- if .Values.cachescout.sharedState.enabled -}}
{{- $_ := set $extra "shared_state" (include "cachescout.sharedState" . | fromJson) -}}
{{- end -}}
{{- if .Values.cachescout.gpuWarmup.enabled -}}
{{- $_ := set $extra "gpu_warmup_url" (printf "http://127.0.0.1:%v" .Values.vllm.port) -}}
{{- end -}}
{{- $ours := dict "kv_connector" "CacheScoutConnector" "kv_connector_module_path" "cachescout.connector" "kv_role" "kv_both" "kv_connector_extra_config" $extra -}}
{{- if and .Values.lmcache.enabled (not (hasKey $extra "lmcache_cpu_gib")) -}}
{{- $_ := set $extra "lmcache_cpu_gib" .Values.lmcache.cpuGiB -}}
{{- end -}}
{{- if .Values.lmcache.enabled -}}
{{- $lm := dict "kv_connector" "LMCacheConnectorV1" "kv_role" "kv_both" -}}
{{- toJson (dict "kv_connector" "MultiConnector" "kv_role" "kv_both" "kv_connector_extra_config" (dict "connectors" (list $ours $lm))) -}}
{{- else -}}
{{- toJson $ours -}}
{{- end -}}
{{- end -}}

{{/* The Secret's keys as files under /secrets (read by the start scripts and CacheScout). */}}
{{- define "cachescout.authVolume" -}}
- name: auth
  secret:
    secretName: {{ include "cachescout.secretName" .root }}
    defaultMode: 0440
    items:
      {{- range .keys }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end -}}

{{/* Startup, readiness and liveness probes of a Redis or Sentinel container: PING as the default
user (allowed nothing else). `startupFailures` x 2 s covers loading (AOF replay). */}}
{{- define "cachescout.redisProbes" -}}
{{- $ping := printf "%s ping | grep -q PONG" (include "cachescout.redisCli" (dict "Values" .Values "port" .port)) -}}
startupProbe:
  exec:
    command: ["sh", "-c", {{ $ping | quote }}]
  periodSeconds: 2
  failureThreshold: {{ .startupFailures }}
readinessProbe:
  exec:
    command: ["sh", "-c", {{ $ping | quote }}]
  periodSeconds: 5
livenessProbe:
  exec:
    command: ["sh", "-c", {{ $ping | quote }}]
  periodSeconds: 10
  failureThreshold: 6
  timeoutSeconds: 5
{{- end -}}

{{/* The TLS Secret (tls.crt, tls.key, ca.crt) mounted at /tls (with tls.enabled). */}}
{{- define "cachescout.tlsMount" -}}
- name: tls
  mountPath: /tls
  readOnly: true
{{- end -}}

{{- define "cachescout.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end -}}

{{/*
Combinations the schema cannot express and that would render objects which cannot run.
*/}}
{{- define "cachescout.validate" -}}
{{- $s := .Values.stateRedis.sentinel }}
{{- if and .Values.stateRedis.enabled $s.enabled (gt (int $s.quorum) (int $s.replicas)) }}
{{- fail (printf "stateRedis.sentinel.quorum (%d) must be at most stateRedis.sentinel.replicas (%d): no failover could ever reach it" (int $s.quorum) (int $s.replicas)) }}
{{- end }}
{{- if gt (atoi .Values.vllm.pythonHashSeed) 4294967295 }}
{{- fail (printf "vllm.pythonHashSeed must be 0-4294967295 (Python refuses %s at start-up)" .Values.vllm.pythonHashSeed) }}
{{- end }}
{{- if and .Values.cachescout.sharedState.enabled (not .Values.stateRedis.enabled) }}
{{- fail "cachescout.sharedState.enabled needs stateRedis.enabled (the shared state lives there)" }}
{{- end }}
{{- if and .Values.lmcache.enabled (not .Values.kvRedis.enabled) }}
{{- fail "lmcache.enabled needs kvRedis.enabled (LMCache's Redis tier lives there)" }}
{{- end }}
{{- end }}
