"""The TGIS proto (`generation.proto`) and the modules grpcio-tools generates from it,
committed (`generate.py` makes them; a test checks they are current), so that serving
needs grpcio and protobuf only, not grpcio-tools."""
