"""Raven: an edge tunnel gateway for scraping edge nodes by name."""

__version__ = "0.1.0"
