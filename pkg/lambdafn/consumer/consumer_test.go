package consumer_test

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/lambdafn/consumer"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/transport/nats"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

func TestConfigFromEnv(t *testing.T) {
	tests := []struct {
		name, consumer, wantErr string
		env                     map[string]string
	}{
		{"ok", "orders-projection", "", nil},
		{"no name", "", "FIFOBOX_CONSUMER_NAME", nil},
		{"margin and logs", "c", "", map[string]string{"FIFOBOX_DEADLINE_MARGIN": "2s", "FIFOBOX_LOG_AGGREGATE_IDS": "true"}},
		{"bad margin", "c", "FIFOBOX_DEADLINE_MARGIN", map[string]string{"FIFOBOX_DEADLINE_MARGIN": "soon"}},
		{"bad log flag", "c", "FIFOBOX_LOG_AGGREGATE_IDS", map[string]string{"FIFOBOX_LOG_AGGREGATE_IDS": "maybe"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("FIFOBOX_CONSUMER_NAME", tt.consumer)
			for _, k := range []string{"FIFOBOX_DEADLINE_MARGIN", "FIFOBOX_LOG_AGGREGATE_IDS"} {
				t.Setenv(k, tt.env[k])
			}
			_, err := consumer.ConfigFromEnv()
			if tt.wantErr == "" && err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("error = %v, want one naming %s", err, tt.wantErr)
			}
		})
	}
}

// The consumer function's handler comes from the transport's Lambda event
// source; a transport without one (NATS) and an SNS deployment without its
// DLQ fail init naming the variable.
func TestNewNeedsALambdaEventSource(t *testing.T) {
	cfg := consumer.Config{Consumer: "c"}
	natsT, err := nats.New(nats.Config{URL: nats.DefaultURL, Topology: nats.Holdco()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := consumer.New(natsT, nil, readmodel.Apply, nil, cfg); err == nil || !strings.Contains(err.Error(), "FIFOBOX_TRANSPORT=nats") {
		t.Fatalf("nats: error %v, want one naming FIFOBOX_TRANSPORT=nats", err)
	}
	snsT, err := sns.New(sns.Config{SNS: noSNS{}, SQS: &dlq{}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := consumer.New(snsT, nil, readmodel.Apply, nil, cfg); err == nil || !strings.Contains(err.Error(), "FIFOBOX_DLQ_URL") ||
		!strings.Contains(err.Error(), "FIFOBOX_TRANSPORT=sns") {
		t.Fatalf("sns without a DLQ: error %v, want one naming FIFOBOX_DLQ_URL and FIFOBOX_TRANSPORT=sns", err)
	}
}

// noSNS is an SNS client the consumer never calls.
type noSNS struct{ sns.SNSAPI }

type dlq struct {
	sns.SQSAPI // only SendMessage is called
	mu         sync.Mutex
	sent       int
}

func (d *dlq) SendMessage(context.Context, *sqs.SendMessageInput, ...func(*sqs.Options)) (*sqs.SendMessageOutput, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.sent++
	return &sqs.SendMessageOutput{MessageId: aws.String("m")}, nil
}

func record(t *testing.T, id string, e envelope.Envelope) events.SQSMessage {
	t.Helper()
	body, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return events.SQSMessage{MessageId: id, Body: string(body),
		Attributes: map[string]string{"MessageGroupId": e.AggregateID, "ApproximateReceiveCount": "1"}}
}

// The wired handler applies the read model once per event, acknowledges an
// invalid record by dead-lettering it, and writes one valid EMF line per batch.
func TestOrdersProjectionBatch(t *testing.T) {
	db := pgtest.New(t)
	var out bytes.Buffer
	d := &dlq{}
	tr, err := sns.New(sns.Config{SNS: noSNS{}, SQS: d, DLQURL: "http://dlq"})
	if err != nil {
		t.Fatal(err)
	}
	fn, err := consumer.New(tr, db.Pool, readmodel.ForConsumer("orders-projection"), metrics.New(&out, ""),
		consumer.Config{Consumer: "orders-projection"})
	if err != nil {
		t.Fatal(err)
	}
	handle, ok := fn.(func(context.Context, events.SQSEvent) (events.SQSEventResponse, error))
	if !ok {
		t.Fatalf("handler is a %T, want an SQS batch handler", fn)
	}
	created, _ := envelope.New("order.created", "order", "o-1", readmodel.OrderEvent{OrderID: "o-1", AmountCents: 500, Currency: "EUR"})
	created.Sequence = 1
	paid, _ := envelope.New("order.paid", "order", "o-1", readmodel.OrderEvent{OrderID: "o-1"})
	paid.Sequence = 2
	batch := events.SQSEvent{Records: []events.SQSMessage{
		record(t, "1", created), record(t, "2", created), // delivered twice
		record(t, "3", paid),
		{MessageId: "4", Body: `{"v":1,"id":"not-a-uuid"}`, Attributes: map[string]string{"MessageGroupId": "o-2"}},
	}}
	resp, err := handle(context.Background(), batch)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.BatchItemFailures) != 0 {
		t.Fatalf("failures = %+v, want none (the invalid record goes to the DLQ)", resp.BatchItemFailures)
	}
	var status string
	var count int
	if err := db.Pool.QueryRow(context.Background(), `SELECT status, event_count FROM orders_read_model WHERE order_id = 'o-1'`).Scan(&status, &count); err != nil {
		t.Fatal(err)
	}
	if status != "paid" || count != 2 {
		t.Fatalf("read model = %s/%d, want paid/2", status, count)
	}
	if d.sent != 1 {
		t.Fatalf("DLQ sends = %d, want 1", d.sent)
	}
	line := bytes.TrimSpace(out.Bytes())
	doc, err := metrics.Validate(line)
	if err != nil {
		t.Fatalf("EMF line invalid: %v\n%s", err, line)
	}
	if doc["Processed"] != float64(2) || doc["Duplicates"] != float64(1) || doc["Failures"] != float64(1) || doc["Consumer"] != "orders-projection" {
		t.Fatalf("metrics = %v", doc)
	}
}
