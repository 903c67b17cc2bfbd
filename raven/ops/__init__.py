"""What operators see of each service: its Prometheus metrics (``metrics``) and its ops listener (``server``:
/metrics, /healthz, /readyz, plus the extra endpoints a service adds, such as the gateway's /status).
"""
