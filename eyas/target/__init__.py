"""The target model: what a spec names and its family (family), --dtype/--device (device), the one-time GGUF
conversion and weight fingerprints (convert), loading with its identity and end-of-turn tokens (load), and
capture of the residual stream by layout with hooks (capture); opening a target with its chat template (open), offline
(no hub access: eyas.target.offline.hub_offline).
"""
