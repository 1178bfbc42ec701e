"""Validation jobs against a live endpoint, with JSON and JUnit XML reports."""
