"""The live dashboard at /dashboard (docs/dashboard.md): routes.py (thin), data.py and
traffic.py (what it shows, read from the stores, no FastAPI), schemas.py (its JSON answers),
static/ (the page: HTML, JS and CSS shipped in the package, no CDN)."""
