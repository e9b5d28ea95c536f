"""Measurement: Prometheus metrics, ETTR, stalls, timelines, benchmark reports."""
