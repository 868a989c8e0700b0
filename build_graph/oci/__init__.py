"""OCI images: the deterministic tar writer (tarball.py, also run in the sandbox), the image's JSON
documents (image.py), and loading a built image into a Docker daemon (load.py)."""
