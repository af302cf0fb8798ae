"""Distributed K-FAC preconditioner (placeholder until the K-FAC issue lands)."""
