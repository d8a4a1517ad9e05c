"""Pure state machines and rules shared by the roles: routing, membership, cluster state,
coordination, batching, replication bookkeeping.  Never imports zmq or asyncio; time is an
argument.
"""
