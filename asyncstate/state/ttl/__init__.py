"""State time-to-live (TTL): entries of a state expire a configured time after their last
access.

- `config`: `StateTtlConfig`, its builder and the enums users configure it with;
- `layout`: the stored form of a timestamped value, shared by every backend and the
  checkpoint format, and the expiry rule;
- `tracker`: what a backend needs to clean one state up (its duration, time source and
  strategies) and a lower bound on the expiration of its entries;
- `states`: the TTL states, which stamp every write and every read with the time it was
  issued;
- `timers`: exact cleanup with timers (each write registers a cleanup timer under its key);
- `declare`: declaring a TTL state on an operator (layout checks, migration, cleanup).

docs/ttl.md describes the semantics and how they differ from Flink's.
"""
