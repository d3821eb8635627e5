package nats_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	nats "github.com/fifobox/fifobox/pkg/transport/nats"
)

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) lines(msg string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, l := range strings.Split(s.b.String(), "\n") {
		if strings.Contains(l, msg) {
			out = append(out, l)
		}
	}
	return out
}

// TestUnroutedPolicy: ticketing has no consumer for order_refunded. Under
// the default policy the event is delivered (the stream keeps it) and
// reported; under the alternate policy it goes to the dead-letter stream's
// unrouted subject. Either way the aggregate's next event follows.
func TestUnroutedPolicy(t *testing.T) {
	t.Parallel()
	for _, policy := range []string{"", transport.UnroutedAlternate} {
		t.Run("policy="+policy, func(t *testing.T) {
			t.Parallel()
			topo := nats.Ticketing()
			topo.Unrouted.Policy = policy
			cfg := setup(t, topo)
			logs := &syncBuffer{}
			cfg.Logger = slog.New(slog.NewJSONHandler(logs, nil))
			pub := newPublisher(t, cfg)
			ctx := context.Background()
			refunded := message(newEvent("order", "o-1", "order_refunded", 1))
			cancelled := message(newEvent("order", "o-1", "order_cancelled", 2))
			for _, m := range []outbox.Message{refunded, cancelled} {
				if err := pub.Publish(ctx, []outbox.Message{m})[0]; err != nil {
					t.Fatalf("%s: %v, want published", m.EventType, err)
				}
			}
			if n := pub.Stats().Unrouted; n != 1 {
				t.Errorf("Stats().Unrouted = %d, want 1", n)
			}
			if l := logs.lines(transport.UnroutedLogMessage); len(l) != 1 || !strings.Contains(l[0], refunded.EventID) || strings.Contains(l[0], "o-1") {
				t.Errorf("unrouted log lines %q: want one naming the event, not the aggregate id", l)
			}
			r := dialRaw(t)
			top := cfg.Topology
			if err := top.Prepare(); err != nil {
				t.Fatal(err)
			}
			if policy == transport.UnroutedAlternate {
				got := r.all(top.DeadLetterStream, top.Unrouted.Subject+".>")
				if len(got) != 1 || got[0].Headers().Get(nats.HeaderEventID) != refunded.EventID {
					t.Fatalf("dead-letter stream's unrouted subject holds %d messages, want order_refunded", len(got))
				}
			}
			if got := r.all(top.Stream, top.SubjectPrefix+".order_cancelled"); len(got) != 1 {
				t.Fatalf("the aggregate's next event: %d stored, want 1", len(got))
			}
		})
	}
}

// TestUnroutedSubjectNoStreamCaptures: a stream created by hand (a team's
// own) captures only the subjects its consumers read. An event type no
// consumer selects then has a subject no stream captures: under the
// default policy it counts as delivered instead of going dead and parking
// its aggregate; an event a consumer does select but the stream misses is
// still a permanent error (the stream and the topology disagree).
func TestUnroutedSubjectNoStreamCaptures(t *testing.T) {
	t.Parallel()
	needServer(t)
	topo := isolateTopology(t, nats.Ticketing())
	r := dialRaw(t)
	ctx := context.Background()
	if _, err := r.js.CreateStream(ctx, jetstream.StreamConfig{Name: topo.Stream, Subjects: []string{topo.SubjectPrefix + ".order_confirmed", topo.SubjectPrefix + ".order_cancelled"},
		Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	pub := newPublisher(t, nats.Config{URL: serverURL(), Topology: topo, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	if err := pub.Publish(ctx, []outbox.Message{message(newEvent("order", "o-1", "order_refunded", 1))})[0]; err != nil {
		t.Fatalf("event no consumer selects, on a subject no stream captures: %v, want delivered", err)
	}
	if pub.Stats().Unrouted != 1 || len(logs.lines(transport.UnroutedLogMessage)) != 1 {
		t.Errorf("not reported: stats %+v", pub.Stats())
	}
	err := pub.Publish(ctx, []outbox.Message{message(newEvent("hold", "h-1", "hold_created", 1))})[0]
	if !envelope.IsPermanent(err) || !strings.Contains(err.Error(), nats.ErrSubjectNotBound.Error()) {
		t.Fatalf("event a consumer selects on an uncaptured subject: %v, want permanent ErrSubjectNotBound", err)
	}
	if err := pub.Publish(ctx, []outbox.Message{message(newEvent("order", "o-1", "order_cancelled", 2))})[0]; err != nil {
		t.Fatalf("the aggregate's next event: %v", err)
	}
}

func TestUnroutedPolicyValidation(t *testing.T) {
	for _, u := range []nats.Unrouted{{Policy: "drop"}, {Policy: "deliver", Subject: "x"}, {Policy: "alternate", Subject: "ticketing.x"}, {Policy: "alternate", Subject: "ticketing_dlq"}} {
		topo := nats.Ticketing()
		topo.Unrouted = u
		if err := topo.Prepare(); err == nil || !strings.Contains(err.Error(), "unrouted") {
			t.Errorf("%+v: %v, want an error naming unrouted", u, err)
		}
	}
}

// isolateTopology is isolate with the topology prepared.
func isolateTopology(t *testing.T, topo nats.Topology) nats.Topology {
	topo = isolate(t, topo)
	if err := topo.Prepare(); err != nil {
		t.Fatal(err)
	}
	return topo
}
