// --grpc_channel_args parsing (server and moeserve-cli): integer grpc.* arguments in order;
// anything else is refused naming the entry.
#include "moeserve/v1/channel_args.h"

#include <gtest/gtest.h>

namespace moeserve::v1wire {
namespace {

TEST(ChannelArgsTest, ParsesIntegerGrpcArgumentsInOrder) {
  auto args = ParseChannelArgs("grpc.http2.max_frame_size=1048576,,grpc.x=-3");
  ASSERT_TRUE(args.ok()) << args.status();
  ASSERT_EQ(args->size(), 2u);
  EXPECT_EQ((*args)[0], (std::pair<std::string, int>{"grpc.http2.max_frame_size", 1048576}));
  EXPECT_EQ((*args)[1], (std::pair<std::string, int>{"grpc.x", -3}));
  EXPECT_TRUE(ParseChannelArgs("")->empty());
}

TEST(ChannelArgsTest, RefusesWhatIsNotGrpcNameEqualsInteger) {
  for (const char* bad : {"foo", "grpc.x", "grpc.x=", "grpc.x=big", "grpc.x=1.5", "http2.x=1",
                          "grpc.x=99999999999", "grpc.a=1,grpc.b"}) {
    const auto args = ParseChannelArgs(bad);
    ASSERT_FALSE(args.ok()) << bad;
    EXPECT_EQ(args.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(args.status().message().find("expected grpc.NAME=INTEGER"), std::string::npos)
        << args.status();
  }
}

}  // namespace
}  // namespace moeserve::v1wire
