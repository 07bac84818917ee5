"""The autoscaler: owns the engine replica count (DESIGN.md, "The autoscaler")."""
