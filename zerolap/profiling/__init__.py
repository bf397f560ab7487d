"""Measurement: overlap efficiency, timelines, memory against the ZeRO formulas."""
