"""radixserve.server.openai"""
