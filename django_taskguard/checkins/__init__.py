"""Check-ins to the monitors teams already watch: exactly one per slot (docs/monitoring.md)."""
