"""The graph vocabulary every floor above shares: what one network of a pipeline is as a graph
(its inputs, outputs, dynamic axes and role), what a graph is traced from, and the geometry of
one sample (frames, height, width). Nothing here knows a family, an exporter or a runtime."""
