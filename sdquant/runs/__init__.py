"""Each script's config settled once, at its edge, into a typed, read-only run: the model with its
family and what its folder declares, the checkpoint checked, the sample geometry, guidance and step
cache, the files each stage runs from. Every value is checked here, before any work; below this
package nothing reads the Hydra config."""
