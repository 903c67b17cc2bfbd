"""Raven cloud side: tunnel endpoint, registry and selection, proxy front end."""
