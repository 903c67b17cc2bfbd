"""Node names in DNS: the hosts file Raven renders and publishes (``hosts``), and ``raven dns check`` (``check``)."""
