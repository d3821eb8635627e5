package nats_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	nats "github.com/fifobox/fifobox/pkg/transport/nats"
)

func TestPublishSubjectsAndHeaders(t *testing.T) {
	t.Parallel()
	cfg := setup(t, nats.Holdco())
	pub := newPublisher(t, cfg)
	e := newEvent("payment intent", "pi-1", "failed.hard", 7)
	e.TraceParent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	m := message(e)
	if err := pub.Publish(context.Background(), []outbox.Message{m})[0]; err != nil {
		t.Fatal(err)
	}
	r := dialRaw(t)
	got := r.all(cfg.Topology.Stream, cfg.Topology.SubjectPrefix+".>")
	if len(got) != 1 {
		t.Fatalf("%d messages, want 1", len(got))
	}
	// Space and dot in the values are sanitised: two tokens after the prefix.
	if want := cfg.Topology.SubjectPrefix + ".payment_intent.failed_hard"; got[0].Subject() != want {
		t.Errorf("subject %q, want %q", got[0].Subject(), want)
	}
	h := got[0].Headers()
	for k, want := range map[string]string{
		nats.HeaderMsgID: e.ID, nats.HeaderEventID: e.ID, nats.HeaderEventType: "failed.hard",
		nats.HeaderAggregateType: "payment intent", nats.HeaderAggregateID: "pi-1", nats.HeaderSequence: "7",
		nats.HeaderTenantID: "acme", nats.HeaderContentType: "application/json",
	} {
		if h.Get(k) != want {
			t.Errorf("header %s = %q, want %q", k, h.Get(k), want)
		}
	}
	if v := h["traceparent"]; len(v) != 1 || v[0] != e.TraceParent {
		t.Errorf("traceparent header %v (headers %v)", v, h)
	}
}

// TestRepublishInsideTheDuplicateWindowIsDropped: the same event published
// again (a dispatcher retry after a lost acknowledgement) is acknowledged as
// a duplicate and not stored twice.
func TestRepublishInsideTheDuplicateWindowIsDropped(t *testing.T) {
	t.Parallel()
	cfg := setup(t, nats.Corewrite())
	pub := newPublisher(t, cfg)
	ctx := context.Background()
	m := message(newEvent("doc", "d-1", "doc.written", 1))
	for i := 0; i < 3; i++ {
		if err := pub.Publish(ctx, []outbox.Message{m})[0]; err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}
	if st := pub.Stats(); st.Stored != 1 || st.Duplicates != 2 {
		t.Errorf("stats %+v, want 1 stored and 2 duplicates", st)
	}
	// The raw PubAck of one more copy says so.
	r := dialRaw(t)
	msg := &natsgo.Msg{Subject: cfg.Topology.SubjectPrefix + ".doc.doc_written", Data: m.Body, Header: natsgo.Header{nats.HeaderMsgID: {m.EventID}}}
	ack, err := r.js.PublishMsg(ctx, msg)
	if err != nil || !ack.Duplicate {
		t.Fatalf("raw republish: %+v %v, want a duplicate PubAck", ack, err)
	}
	if n := r.msgs(cfg.Topology.Stream); n != 1 {
		t.Errorf("stream holds %d messages, want 1", n)
	}
}

// TestDispatcherRepublishIsDropped: the dispatcher believes its first
// publish failed (the acknowledgement "was lost") and publishes the same
// events again; the stream keeps one copy of each, and the consumers apply
// each once.
func TestDispatcherRepublishIsDropped(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfg := setup(t, nats.Corewrite())
	if err := cfg.Topology.Prepare(); err != nil {
		t.Fatal(err)
	}
	pub := newPublisher(t, cfg)
	lost := true
	lossy := outbox.PublisherFunc(func(ctx context.Context, msgs []outbox.Message) []error {
		errs := pub.Publish(ctx, msgs)
		if lost {
			lost = false
			for i, err := range errs {
				if err == nil {
					errs[i] = errors.New("PubAck lost (simulated)")
				}
			}
		}
		return errs
	})
	ctx := context.Background()
	for i := 0; i < 5; i++ {
		e := newEvent("doc", "d-"+string(rune('a'+i)), "doc.written", 0)
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, e) }); err != nil {
			t.Fatal(err)
		}
	}
	d, err := outbox.NewDispatcher(db.Pool, lossy, outbox.DispatcherConfig{BackoffBase: 10 * time.Millisecond, BackoffCap: 50 * time.Millisecond, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20 && d.Totals().Sent < 5; i++ {
		if err := d.Drain(ctx); err != nil {
			t.Fatal(err)
		}
		time.Sleep(60 * time.Millisecond)
	}
	if tot := d.Totals(); tot.Sent != 5 {
		t.Fatalf("dispatcher totals %+v, want 5 sent", tot)
	}
	st := pub.Stats()
	if st.Stored != 5 || st.Duplicates < 1 {
		t.Errorf("publisher stats %+v: want 5 stored and the republished ones as duplicates", st)
	}
	if n := dialRaw(t).msgs(cfg.Topology.Stream); n != 5 {
		t.Errorf("stream holds %d messages, want 5", n)
	}
	t.Logf("publisher stats %+v", st)
}

// TestPublishOutcomes pins the documented outcome of each failure.
func TestPublishOutcomes(t *testing.T) {
	t.Parallel()
	needServer(t)
	ctx := context.Background()
	base := setup(t, nats.Corewrite()) // stream A, prefix A
	other := setup(t, nats.Corewrite())
	small := nats.Corewrite()
	small.MaxMsgSize = 2048
	smallCfg := setup(t, small)
	px := newProxy(t)

	stalled := base
	stalled.URL = proxyURL(px)
	stalled.AckTimeout = 300 * time.Millisecond

	tests := []struct {
		name      string
		cfg       func() nats.Config
		msg       func() outbox.Message
		before    func()
		want      error // nil: success
		permanent bool
	}{
		{name: "stored", cfg: func() nats.Config { return base }},
		{name: "body over the topology's max_msg_size", cfg: func() nats.Config { return smallCfg },
			msg: func() outbox.Message {
				m := message(newEvent("doc", "d-1", "doc.written", 1))
				m.Body = append(m.Body, make([]byte, 4096)...)
				return m
			}, want: nats.ErrTooLarge, permanent: true},
		{name: "body over the stream's max_msg_size (config disagrees with the stream)",
			cfg: func() nats.Config {
				c := smallCfg
				c.Topology.MaxMsgSize = 1 << 20
				return c
			},
			msg: func() outbox.Message {
				m := message(newEvent("doc", "d-1", "doc.written", 1))
				m.Body = append(m.Body, make([]byte, 4096)...)
				return m
			}, want: nats.ErrTooLarge, permanent: true},
		{name: "body over the server's max_payload", cfg: func() nats.Config {
			c := base
			c.Topology.MaxMsgSize = 8 << 20
			return c
		},
			msg: func() outbox.Message {
				m := message(newEvent("doc", "d-1", "doc.written", 1))
				m.Body = make([]byte, 2<<20)
				return m
			}, want: nats.ErrTooLarge, permanent: true},
		{name: "subject bound to another stream", cfg: func() nats.Config {
			c := base
			c.Topology.SubjectPrefix = other.Topology.SubjectPrefix
			return c
		}, want: nats.ErrWrongStream, permanent: true},
		{name: "subject not bound to the stream", cfg: func() nats.Config {
			c := base
			c.Topology.SubjectPrefix = "unbound" + base.Topology.SubjectPrefix
			return c
		}, want: nats.ErrSubjectNotBound, permanent: true},
		{name: "stream missing (not provisioned)", cfg: func() nats.Config {
			c := base
			c.Topology.Stream += "_MISSING"
			c.Topology.SubjectPrefix = "unbound" + base.Topology.SubjectPrefix
			return c
		}, want: nats.ErrNoStream},
		{name: "server unreachable", cfg: func() nats.Config {
			c := base
			c.URL = "nats://127.0.0.1:1"
			c.ConnectWait = 200 * time.Millisecond
			return c
		}, want: nats.ErrUnavailable},
		{name: "no PubAck in time (server hangs)", cfg: func() nats.Config { return stalled },
			before: px.Pause, want: nats.ErrNoAck},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pub := newPublisher(t, tt.cfg())
			m := message(newEvent("doc", "d-1", "doc.written", 1))
			if tt.msg != nil {
				m = tt.msg()
			}
			if tt.before != nil {
				// Connect first, so the failure is the missing PubAck.
				warm := message(newEvent("doc", "d-0", "doc.written", 1))
				if err := pub.Publish(ctx, []outbox.Message{warm})[0]; err != nil {
					t.Fatalf("warm-up publish: %v", err)
				}
				tt.before()
				defer px.Resume()
			}
			err := pub.Publish(ctx, []outbox.Message{m})[0]
			switch {
			case tt.want == nil && err != nil:
				t.Fatalf("got %v, want success", err)
			case tt.want != nil && !errors.Is(err, tt.want):
				t.Fatalf("got %v, want %v", err, tt.want)
			case tt.want != nil && envelope.IsPermanent(err) != tt.permanent:
				t.Fatalf("got %v: permanent %v, want %v", err, envelope.IsPermanent(err), tt.permanent)
			}
		})
	}
}

// TestPublisherRecoversFromConnectionLoss: after the connection is cut the
// publisher's calls fail retryably (never permanently) until the client has
// reconnected, then succeed, without anyone restarting it.
func TestPublisherRecoversFromConnectionLoss(t *testing.T) {
	t.Parallel()
	cfg := setup(t, nats.Corewrite())
	px := newProxy(t)
	cfg.URL = proxyURL(px)
	cfg.AckTimeout = time.Second
	pub := newPublisher(t, cfg)
	ctx := context.Background()
	if err := pub.Publish(ctx, []outbox.Message{message(newEvent("doc", "d-1", "doc.written", 1))})[0]; err != nil {
		t.Fatal(err)
	}
	px.Cut()
	deadline := time.Now().Add(30 * time.Second)
	var err error
	for seq := int64(2); time.Now().Before(deadline); seq++ {
		if err = pub.Publish(ctx, []outbox.Message{message(newEvent("doc", "d-1", "doc.written", seq))})[0]; err == nil {
			break
		}
		if envelope.IsPermanent(err) {
			t.Fatalf("a dropped connection gave a permanent error: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("publisher did not recover: %v", err)
	}
}

func TestPublishNeverSendsAnAggregatesSecondMessageBeforeTheFirstIsStored(t *testing.T) {
	t.Parallel()
	cfg := setup(t, nats.Corewrite())
	small := cfg
	small.Topology.MaxMsgSize = 8 << 20 // let the oversized one reach the client check
	pub := newPublisher(t, small)
	first := message(newEvent("doc", "d-1", "doc.written", 1))
	first.Body = make([]byte, 2<<20) // over the server's max_payload: permanent
	second := message(newEvent("doc", "d-1", "doc.deleted", 2))
	other := message(newEvent("doc", "d-2", "doc.written", 1))
	errs := pub.Publish(context.Background(), []outbox.Message{first, second, other})
	if !errors.Is(errs[0], nats.ErrTooLarge) || !errors.Is(errs[1], nats.ErrPredecessorFailed) || errs[2] != nil {
		t.Fatalf("got %v", errs)
	}
	if n := dialRaw(t).msgs(cfg.Topology.Stream); n != 1 {
		t.Fatalf("stream holds %d messages, want only the other aggregate's", n)
	}
}

func TestProvisionIsIdempotentAndReportsDrift(t *testing.T) {
	t.Parallel()
	cfg := setup(t, nats.Holdco())
	ctx := context.Background()
	p, _ := nats.NewProvisioner(cfg)
	if err := p.Provision(ctx); err != nil {
		t.Fatalf("second provision: %v", err)
	}
	r := dialRaw(t)
	s, err := r.js.Stream(ctx, cfg.Topology.Stream)
	if err != nil {
		t.Fatal(err)
	}
	info := s.CachedInfo()
	if info.Config.Duplicates != 10*time.Minute || info.Config.Storage != jetstream.FileStorage || info.Config.Retention != jetstream.InterestPolicy {
		t.Errorf("stream config %+v", info.Config)
	}
	for _, name := range []string{"analytics", "erp", "notifications"} {
		c, err := s.Consumer(ctx, name)
		if err != nil {
			t.Fatalf("consumer %s: %v", name, err)
		}
		if cc := c.CachedInfo().Config; cc.AckPolicy != jetstream.AckExplicitPolicy || cc.MaxDeliver != 16 || cc.MaxAckPending != 1000 {
			t.Errorf("consumer %s config %+v", name, cc)
		}
	}
	if _, err := r.js.Stream(ctx, cfg.Topology.Stream+"_DLQ"); err != nil {
		t.Errorf("dead-letter stream: %v", err)
	}

	// Changed settings are reported, not applied.
	changed := cfg
	changed.Topology.DuplicateWindow = transport.Duration(20 * time.Minute)
	changed.Topology.Consumers = append([]nats.Consumer(nil), cfg.Topology.Consumers...)
	changed.Topology.Consumers[1].MaxAckPending = 500
	p2, err := nats.NewProvisioner(changed)
	if err != nil {
		t.Fatal(err)
	}
	err = p2.Provision(ctx)
	if !errors.Is(err, nats.ErrTopologyConflict) || !strings.Contains(err.Error(), "duplicate_window") ||
		!strings.Contains(err.Error(), "consumer erp max_ack_pending is 1000") {
		t.Fatalf("provisioning changed settings: %v, want ErrTopologyConflict naming both", err)
	}
	s, _ = r.js.Stream(ctx, cfg.Topology.Stream)
	if s.CachedInfo().Config.Duplicates != 10*time.Minute {
		t.Errorf("the stream was changed: duplicates %s", s.CachedInfo().Config.Duplicates)
	}
	c, _ := s.Consumer(ctx, "erp")
	if c.CachedInfo().Config.MaxAckPending != 1000 {
		t.Errorf("the consumer was changed: max_ack_pending %d", c.CachedInfo().Config.MaxAckPending)
	}
}
