"""The pipeline behind Ray Serve (serve.py): request bodies and their checks, which requests share a
call, the model replica, the HTTP ingress and its metrics."""
