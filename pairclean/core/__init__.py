"""The OSA scoring core shared offline and online: cosine, cone bias beta, weight functions, mixtures."""
