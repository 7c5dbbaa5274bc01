"""Transport trust: TLS between the services, certificates as identity (issue 32).

identity.py reads who the peer is from its certificate; certs.py (pagedgen-certs) makes a
development CA and certificates; cli_args.py holds the --tls-* flags every console script takes;
credentials.py turns them into gRPC server and channel credentials.
"""
