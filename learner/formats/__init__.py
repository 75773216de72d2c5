"""The formats shared with the service and the clients, without torch: the ONNX snapshot and its
input rule (`snapshot`), and what a JPEG's markers say before it is decoded (`jpeg_structure`).

Imports nothing else of `learner`, and never torch (the inference replica and the ONNX client
run without it).
"""
