"""WAN bandwidth profiles (``profiles.json``) and tc egress shaping, shared by the
network-namespace topology and the Docker deployment."""
