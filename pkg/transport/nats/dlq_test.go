package nats_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"

	"github.com/fifobox/fifobox/pkg/envelope"
	nats "github.com/fifobox/fifobox/pkg/transport/nats"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

// The shared dead-letter suite on a JetStream dead-letter stream.
func TestDLQControl(t *testing.T) {
	t.Parallel()
	transporttest.ExerciseDLQ(t, dlqHarness)
}

// `fifobox dlq discard` for a consumer with an inbox table of its own.
func TestDLQDiscardIntoOwnInboxTable(t *testing.T) {
	t.Parallel()
	transporttest.DiscardIntoOwnInboxTable(t, dlqHarness(t))
}

func dlqHarness(t *testing.T) transporttest.DLQHarness {
	cfg := setup(t, nats.Ticketing())
	topo := cfg.Topology
	c := topo.Consumers[0]
	ops, err := nats.NewOperations(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ops.Close() })
	r := dialRaw(t)
	taken := 0
	return transporttest.DLQHarness{Ops: ops, Consumer: c.Name, WholeGroups: true,
		Kill: func(t *testing.T, evs []envelope.Envelope) {
			for i, e := range evs {
				body, _ := e.Encode()
				// What the consumer's settler sends to the dead-letter stream.
				m := &natsgo.Msg{Subject: topo.DLQSubject(c), Data: body, Header: natsgo.Header{}}
				m.Header.Set(nats.HeaderAggregateID, e.AggregateID)
				m.Header.Set(nats.HeaderErrorClass, "permanent")
				m.Header.Set(nats.HeaderErrorReason, "cannot apply it")
				m.Header.Set(nats.HeaderDeadAt, time.Now().UTC().Format(time.RFC3339Nano))
				m.Header.Set(nats.HeaderSubject, topo.SubjectPrefix+".thing")
				m.Header.Set(nats.HeaderMsgID, fmt.Sprintf("%s:dead:%d", e.ID, i))
				if _, err := r.js.PublishMsg(context.Background(), m); err != nil {
					t.Fatal(err)
				}
			}
		},
		Queue: func(t *testing.T) []envelope.Envelope {
			// A stream keeps what it holds: return what this harness
			// has not returned yet.
			msgs := r.all(topo.Stream, topo.ReplaySubjectPrefix(c)+".>")
			var out []envelope.Envelope
			for _, m := range msgs[taken:] {
				e, err := envelope.Decode(m.Data())
				if err != nil {
					t.Fatalf("stream holds an invalid message: %v", err)
				}
				out = append(out, e)
			}
			taken = len(msgs)
			return out
		},
	}
}
