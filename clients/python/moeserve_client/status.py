"""A failed call as grpcio's own calls report one (a grpc.RpcError with code() and details()),
for the ways in that are not grpcio's: the forward channel (channel.ChannelError) and the C++
client (native.CallError). Imports only grpc."""

import grpc

CODES = {c.value[0]: c for c in grpc.StatusCode}


class StatusError(grpc.RpcError):
    """status_code: the gRPC status code (int); message: what went wrong."""

    def __init__(self, status_code, message):
        super().__init__(f"{CODES.get(status_code, status_code)}: {message}")
        self.status_code = status_code
        self.message = message

    def code(self):
        return CODES.get(self.status_code, grpc.StatusCode.UNKNOWN)

    def details(self):
        return self.message
