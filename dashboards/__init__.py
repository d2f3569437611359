"""Grafana dashboards built from code (see build.py); the JSON beside this file is generated."""
