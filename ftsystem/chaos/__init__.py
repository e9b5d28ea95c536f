"""Failure injection: chaos specs and orders, their execution, fault points."""
