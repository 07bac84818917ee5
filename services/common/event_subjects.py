"""The NATS subjects of Strata's events (payloads in ``events.proto``)."""

KV_EVENTS = "strata.kv.{replica_id}"  # KvEventBatch
LOAD_REPORTS = "strata.load.{replica_id}"  # LoadReport
ALL_KV_EVENTS = "strata.kv.*"
ALL_LOAD_REPORTS = "strata.load.*"
