package sns_test

import (
	"context"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport/sns"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

// The shared dead-letter suite on SQS FIFO queues of the emulator.
func TestDLQControl(t *testing.T) {
	t.Parallel()
	transporttest.ExerciseDLQ(t, func(t *testing.T) transporttest.DLQHarness {
		topo := topology.Topology{Topic: topology.Topic{Name: "events.fifo", ThroughputScope: "MessageGroup"},
			Consumers: []topology.Consumer{{Name: "c", MaxReceiveCount: 2, FunctionTimeoutSeconds: 1, VisibilityTimeoutSeconds: 6, MaxConcurrency: 2}}}
		env := emulatortest.New(t, topo, 6)
		q := env.Queues["c"]
		tr, err := sns.New(sns.Config{SNS: env.SNS, SQS: env.SQS, Topology: &topo,
			Queues: sns.Queues{"c": {QueueURL: q.URL, DLQURL: q.DLQURL, SubscriptionDLQURL: q.SubDLQURL}}})
		if err != nil {
			t.Fatal(err)
		}
		ops, err := tr.Operations()
		if err != nil {
			t.Fatal(err)
		}
		str := func(s string) sqstypes.MessageAttributeValue {
			return sqstypes.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(s)}
		}
		return transporttest.DLQHarness{Ops: ops, Consumer: "c",
			Kill: func(t *testing.T, evs []envelope.Envelope) {
				for _, e := range evs {
					body, _ := e.Encode()
					// What the consumer's handler sends to its DLQ.
					if _, err := env.SQS.SendMessage(context.Background(), &sqs.SendMessageInput{QueueUrl: aws.String(q.DLQURL),
						MessageBody: aws.String(string(body)), MessageGroupId: aws.String(e.AggregateID), MessageDeduplicationId: aws.String(e.ID),
						MessageAttributes: map[string]sqstypes.MessageAttributeValue{"event_type": str(e.Type),
							sns.AttrErrorClass: str("permanent"), sns.AttrErrorReason: str("cannot apply it")}}); err != nil {
						t.Fatal(err)
					}
				}
			},
			Queue: func(t *testing.T) []envelope.Envelope { return takeQueue(t, env, q.URL) },
		}
	})
}

// takeQueue takes every message waiting in url, in order.
func takeQueue(t *testing.T, env *emulatortest.Env, url string) []envelope.Envelope {
	t.Helper()
	ctx := context.Background()
	var out []envelope.Envelope
	for {
		r, err := env.SQS.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 10, WaitTimeSeconds: 1})
		if err != nil {
			t.Fatal(err)
		}
		if len(r.Messages) == 0 {
			return out
		}
		for _, m := range r.Messages {
			e, err := envelope.Decode([]byte(aws.ToString(m.Body)))
			if err != nil {
				t.Fatalf("queue holds an invalid message: %v", err)
			}
			out = append(out, e)
			if _, err := env.SQS.DeleteMessage(ctx, &sqs.DeleteMessageInput{QueueUrl: aws.String(url), ReceiptHandle: m.ReceiptHandle}); err != nil {
				t.Fatal(err)
			}
		}
	}
}
