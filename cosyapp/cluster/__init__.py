"""Serving from several Pipelines through Ray Serve (``--replicas N``): ``replica.py`` is one
replica's deployment, ``ingress.py`` the object the page and the API call in their place.
Needs the ``cluster`` extra (``ray[serve]``); with one replica nothing here is imported."""
