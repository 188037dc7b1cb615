"""Tests of deploy/: manifests, units, scripts and images."""
