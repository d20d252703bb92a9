"""precast replicas under an orchestration layer (docs/deploy.md).

Ray Serve (`precast serve --replicas N`, the `serve` extra): app.py builds the application, router.py routes by prompt
prefix (affinity.py), proxy.py carries HTTP requests into each replica's app, run.py runs it. NVIDIA Dynamo (the
`dynamo` extra): dynamo_worker.py. Nothing outside this package imports Ray or Dynamo.
"""

# How the ingress picks a replica: router.py's two modes, or Ray's own power-of-two-choices router.
ROUTINGS = ("prefix", "round_robin", "least_loaded")
