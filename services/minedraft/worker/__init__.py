"""The worker services: a drafter (drafter.py), a verifier rank (verifier.py) or a verifier that drafts too
(pair.py) behind the Worker gRPC API (servicer.py). Each node runs its side of every step (engine/step.py) with
its end of the step-end channel; what the nodes share (joining a world, describing themselves) is node.py."""
