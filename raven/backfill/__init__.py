"""What the agent and the gateway share about backfill beyond the wire: how a kept page is compressed."""
