"""The router: many engine replicas behind one `strata.v1.Engine` address, placing each request by
prefix-cache overlap and load, with health checks and failover (DESIGN.md)."""
