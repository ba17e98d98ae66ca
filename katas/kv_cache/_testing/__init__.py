"""What the KV cache's suites share, a module per subject:

- ``caches``: building the caches under test (stages 1 and 2) and hearing ``on_evict``;
- ``model`` and ``machine``: stage 1's exact model and the state machine comparing a
  cache with it; ``callbacks``: what ``on_evict`` sees of the cache; ``expiry``: TTL
  caches at the edges of expiry's bookkeeping; ``keys``: unhashable keys, and every call
  that takes a key;
- ``loaders`` and ``locks``: stage 2's controlled loaders and its probes of a lock;
  ``flights``: whole flights (a leader and its waiters) and a wrapper side by side with
  the bare stage-1 cache; ``races``: stage 2's races forced in a call's gaps (a lazily
  iterated inner cache, a leader raced at each count it updates, a landing right after a
  write); ``timeouts``: waiters for whom time flies, so a load outlasts any timeout;
- ``rings``: measuring a hash ring; ``shards``: a sharded cache over three Redis nodes
  and its state machine; ``wire``: replies held on the wire, commands recorded or held
  before they are sent; ``near``: near caches, their fleet and their state machine
  (stage 3);
- ``placement``: the child process that places keys under another ``PYTHONHASHSEED``.
"""
