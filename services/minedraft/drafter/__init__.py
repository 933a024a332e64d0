"""The drafter service: the draft model on one device."""
