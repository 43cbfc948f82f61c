"""The vLLM KV connector on top of LMCache (`CacheScoutConnector`).

Not built yet: it is tracked as issue 4. This package exists so the namespace layout is in place;
it imports nothing and registers nothing.
"""
