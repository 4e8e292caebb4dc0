"""The web dashboard: plain pages and scripts (no build step) over the HTTP API and its streams.

``dashboard_routes(svc)`` is the router (the page at ``/``, checkpoint listings under the API
prefix); ``STATIC_DIR`` holds the scripts, styles and the vendored chart library (uPlot),
mounted at ``/ui/static``. The pages read the API through one function (``static/api.js``),
the place where credentials are added.
"""
from torchrelay.server.dashboard.routes import STATIC_DIR, STATIC_PREFIX, dashboard_routes

__all__ = ["STATIC_DIR", "STATIC_PREFIX", "dashboard_routes"]
