"""radixserve.distributed"""
