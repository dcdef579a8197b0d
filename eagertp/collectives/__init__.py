"""One module per collective family: how its ops defer, what consumes or
produces them. Importing a module registers its handlers (``eagertp.table``)."""
