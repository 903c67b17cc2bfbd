"""Raven edge side: dialler, node inventory, forwarder to node ports."""
