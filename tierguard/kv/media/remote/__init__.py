"""The "remote" medium: blocks shared by replicas through one Redis (--kv-remote-url).

tier.py      RemoteTier: reads and writes on transfer threads, TTLs, a bounded journal
index.py     what is known to be in Redis without a round trip: own writes + the fleet's journal
breaker.py   circuit breaker: a Redis that is down costs no waiting
"""
