package docs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// scenario is a pipeline in the state the operations docs show: orders
// published and waiting in the consumers' queues, one aggregate retrying
// because its topic is gone, one dead event, and a poison message in
// shipping's DLQ holding its order.
type scenario struct {
	db      *pgtest.DB
	env     *emulatortest.Env
	prefix  string
	dbURL   string
	queues  string // FIFOBOX_QUEUES
	ops     transport.Operations
	deadID  string // the dead outbox event
	poison  string // the DLQ message's key (its event id)
	service *redrive.Service
}

func order(typ, id string) envelope.Envelope {
	e, err := envelope.New(typ, "order", id, readmodel.OrderEvent{OrderID: id, CustomerID: "c-1", AmountCents: 4200, Currency: "EUR"})
	if err != nil {
		panic(err)
	}
	return e
}

func newScenario(t *testing.T) *scenario {
	t.Helper()
	ctx := context.Background()
	s := &scenario{db: pgtest.New(t)}
	s.dbURL = pgtest.WithSearchPath(pgtest.URL(), s.db.Schema)
	topo := topology.Default()
	s.env = emulatortest.New(t, topo, 30)
	s.prefix = strings.TrimSuffix(s.env.TopicARN[strings.LastIndex(s.env.TopicARN, ":")+1:], "fifobox-events.fifo")
	q := sns.Queues{}
	for name, r := range s.env.Queues {
		q[name] = sns.QueueURLs{QueueURL: r.URL, DLQURL: r.DLQURL, SubscriptionDLQURL: r.SubDLQURL}
	}
	b, _ := json.Marshal(q)
	s.queues = string(b)
	tr, err := sns.New(sns.Config{SNS: s.env.SNS, SQS: s.env.SQS, Queues: q, Topology: &topo, TopicARN: s.env.TopicARN, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if s.ops, err = tr.Operations(); err != nil {
		t.Fatal(err)
	}
	if s.service, err = redrive.New(s.db.Pool, redrive.Config{Operations: s.ops, Transport: "sns", Logger: quiet}); err != nil {
		t.Fatal(err)
	}
	enqueue := func(evs ...envelope.Envelope) {
		for _, e := range evs {
			if err := pgx.BeginFunc(ctx, s.db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, e) }); err != nil {
				t.Fatal(err)
			}
		}
	}
	dispatch := func(pub outbox.Publisher) {
		d, err := outbox.NewDispatcher(s.db.Pool, pub, outbox.DispatcherConfig{BackoffBase: time.Hour, BackoffCap: time.Hour, RetryFor: 48 * time.Hour, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Drain(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// Three orders, created and paid, published to the topic.
	for i := 1; i <= 3; i++ {
		id := fmt.Sprintf("order-%d", i)
		enqueue(order("order.created", id), order("order.paid", id))
	}
	pub, err := tr.Publisher()
	if err != nil {
		t.Fatal(err)
	}
	dispatch(pub)
	// order-4 after its topic was deleted (a publisher to a topic that does
	// not exist: the emulator's real NotFound), order-5 rejected for good.
	enqueue(order("order.created", "order-4"))
	gone, err := sns.NewPublisher(s.env.SNS, sns.PublisherConfig{TopicARN: s.env.TopicARN + "-deleted"})
	if err != nil {
		t.Fatal(err)
	}
	dispatch(gone)
	dead := order("order.created", "order-5")
	s.deadID = dead.ID
	enqueue(dead)
	dispatch(outbox.PublisherFunc(func(_ context.Context, msgs []outbox.Message) []error {
		errs := make([]error, len(msgs))
		for i := range msgs {
			errs[i] = envelope.Permanent(errors.New("publish: InvalidParameter: Invalid parameter: Message attribute tenant_id is empty"))
		}
		return errs
	}))
	// shipping's consumer cannot apply order-2's paid event: to its DLQ,
	// and order-2 is held behind it.
	poisoned := map[string]bool{}
	rows, err := s.db.Pool.Query(ctx, `SELECT event_id::text FROM outbox WHERE aggregate_id = 'order-2' AND event_type = 'order.paid'`)
	if err != nil {
		t.Fatal(err)
	}
	ids, _ := pgx.CollectRows(rows, pgx.RowTo[string])
	for _, id := range ids {
		poisoned[id], s.poison = true, id
	}
	r, err := tr.Consumer("shipping", s.db.Pool, func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		if poisoned[e.ID] {
			return envelope.Permanent(errors.New("ship order: no address for customer c-1"))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(rctx) }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		d, _ := s.ops.Depths(ctx, "shipping")
		if len(d) == 1 && d[0].DLQ == 1 && d[0].Ready == 0 && d[0].InFlight == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("shipping never dead-lettered the poison message: %+v", d)
		}
		time.Sleep(100 * time.Millisecond)
	}
	stop()
	<-done
	// Everything published has reached the other queues.
	deadline = time.Now().Add(30 * time.Second)
	for {
		d, _ := s.ops.Depths(ctx, "orders-projection", "audit")
		if len(d) == 2 && d[0].Ready == 6 && d[1].Ready == 6 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("queues never filled: %+v", d)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return s
}

// env sets what the CLI reads to act on the scenario.
func (s *scenario) setEnv(t *testing.T) {
	t.Setenv("AWS_ENDPOINT_URL", s.env.Endpoint)
	t.Setenv("AWS_REGION", "us-east-1")
	t.Setenv("AWS_ACCESS_KEY_ID", "test")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "test")
	t.Setenv("FIFOBOX_DATABASE_URL", s.dbURL)
	t.Setenv("FIFOBOX_QUEUES", s.queues)
	t.Setenv("FIFOBOX_TRANSPORT", "")
	t.Setenv("FIFOBOX_REDRIVE_FUNCTION", "")
	t.Setenv("FIFOBOX_TOPIC_ARN", s.env.TopicARN)
}
