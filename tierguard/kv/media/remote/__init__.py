"""The "remote" medium: blocks shared by replicas through one Redis or a Redis Cluster (--kv-remote-url).

tier.py      RemoteTier: reads and writes on transfer threads, TTLs, a bounded journal
nodes.py     which node holds a key; one pipeline per node (one node, or a cluster's masters)
index.py     what is known to be in Redis without a round trip: own writes + the fleet's journal
breaker.py   circuit breakers, one per node: a node that is down costs no waiting
"""
