"""Panels of the dashboard: nodes, pipeline, bandwidth, chat."""
