package sns

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/topology"
)

// DLQSender sends a message to the dead-letter queue; *sqs.Client satisfies it.
type DLQSender interface {
	SendMessage(ctx context.Context, in *sqs.SendMessageInput, optFns ...func(*sqs.Options)) (*sqs.SendMessageOutput, error)
}

// DLQ message attribute names set when the handler dead-letters a message
// itself (SQS moves messages after maxReceiveCount without them).
const (
	AttrErrorClass  = "fifobox_error_class"
	AttrErrorReason = "fifobox_error_reason"
	AttrConsumer    = "fifobox_consumer"
	AttrSourceQueue = "fifobox_source_queue"
)

// HandlerConfig configures a Handler.
type HandlerConfig struct {
	// Consumer is the inbox key, e.g. "orders-projection". Required.
	Consumer string
	// DLQURL is the queue's dead-letter queue for what the handler
	// dead-letters (invalid, permanent, out of retries, held). Required.
	DLQURL string
	// Order: inbox.OrderStrict (default) or inbox.OrderRelaxed; see inbox.Order.
	Order inbox.Order
	// Inbox is the table the consumer dedupes through (default fifobox's
	// inbox; see inbox.Table).
	Inbox inbox.Table
	// MaxReceiveCount is the queue's maxReceiveCount, after which SQS moves
	// a message to the DLQ itself: a record on its last receive has its
	// group held before the attempt starts (strict order) and is
	// dead-lettered by the handler, with the reason, if it fails, so not
	// even a crash lets the group's next event overtake it. 0: unknown.
	MaxReceiveCount int
	// MaxRetries is how many times an event's side effect may fail before
	// the handler dead-letters it. Failures are counted per event in the
	// database (inbox_parked), not by SQS's receive count, which also counts
	// receives that failed for want of the database or ended in a crash.
	// Default topology.DefaultMaxRetries (at most MaxReceiveCount-1); keep
	// MaxReceiveCount well above it (topology.DefaultMaxReceiveCount) so
	// that a database outage or a crash loop cannot run a record into SQS's
	// own dead-lettering.
	MaxRetries int
	// DeadlineMargin: the handler starts no record once the context's
	// deadline is this close, and reports those records as failed (with no
	// failure counted), so the records it finished are committed and
	// acknowledged instead of the whole batch being lost to the timeout.
	// Default inbox.DefaultDeadlineMargin.
	DeadlineMargin time.Duration
	// LogAggregateIDs adds message group ids (= aggregate ids, which may
	// carry personal data) to log lines (FIFOBOX_LOG_AGGREGATE_IDS). Off by
	// default: log lines name message and event ids only.
	LogAggregateIDs bool
	// Logger; default slog.Default().
	Logger *slog.Logger
	// OnBatch, if set, receives each batch's metrics.
	OnBatch func(inbox.BatchMetrics)
	// OnSettle, if set, is called after each record is settled (tests).
	OnSettle func(inbox.Settlement)
}

// Handler is the SQS FIFO batch handler for a consumer Lambda (and for
// Runner, its local stand-in): the consumer engine every transport shares
// (inbox.Engine) over SQS records, with this queue's DLQ for what it
// dead-letters. A batch's records run on one lane, in one transaction with
// a savepoint each, in the order SQS delivered them.
type Handler struct {
	e   *inbox.Engine
	dlq DLQSender
	cfg HandlerConfig

	mu      sync.Mutex
	batches map[*inbox.Record]*sqsBatch // the running Handle call of each record in hand
}

// NewHandler returns a Handler applying events with apply.
func NewHandler(db inbox.DB, dlq DLQSender, apply inbox.Apply, cfg HandlerConfig) (*Handler, error) {
	switch {
	case dlq == nil:
		return nil, errors.New("new inbox handler: dlq sender is nil")
	case cfg.DLQURL == "":
		return nil, errors.New("new inbox handler: DLQURL is required")
	case cfg.MaxReceiveCount < 0 || cfg.MaxRetries < 0:
		return nil, errors.New("new inbox handler: MaxReceiveCount and MaxRetries must not be negative")
	}
	if cfg.MaxRetries == 0 {
		cfg.MaxRetries = topology.Consumer{MaxReceiveCount: cfg.MaxReceiveCount}.Retries()
	}
	h := &Handler{dlq: dlq, cfg: cfg, batches: map[*inbox.Record]*sqsBatch{}}
	e, err := inbox.NewEngine(db, apply, inbox.EngineConfig{
		ConsumerConfig: inbox.ConsumerConfig{Consumer: cfg.Consumer, Inbox: cfg.Inbox, Order: cfg.Order, MaxBatch: 10, DeadlineMargin: cfg.DeadlineMargin,
			LogAggregateIDs: cfg.LogAggregateIDs, Logger: cfg.Logger, OnSettle: h.settled},
		// One lane: a Lambda batch (at most 10) is one transaction, in order.
		Lanes:      1,
		MaxRetries: cfg.MaxRetries,
		// SQS redelivers after the visibility timeout (the park's due time
		// is only for operators: the FIFO group keeps the record's
		// successors back).
		RetryDelay:        func(int) time.Duration { return 30 * time.Second },
		OrderedRedelivery: true,
	})
	if err != nil {
		return nil, fmt.Errorf("new inbox handler: %w", err)
	}
	h.e = e
	return h, nil
}

// sqsBatch is one Handle call: its failures and metrics.
type sqsBatch struct {
	mu     sync.Mutex
	failed []events.SQSBatchItemFailure
	m      inbox.BatchMetrics
}

// Handle processes a batch in order and reports partial failures the way
// Lambda's SQS FIFO event source needs them: applied and duplicate records
// are deleted; a record that failed transiently is reported failed, and so
// is every later record of its group (the FIFO group brings them back in
// order); invalid and permanently failing records, records out of retries
// (or failing on their last receive) go to the DLQ at once with the reason,
// and in strict order hold their group (inbox_held): the group's later
// records go to the DLQ behind them until a redrive. While the database is
// unreachable the batch waits in place until DeadlineMargin before the
// deadline and is then reported failed, with no failure counted. The
// returned error is non-nil only if a record has no message id to report
// (then Lambda retries the whole batch, which the inbox makes safe) or one
// could not be sent to the DLQ.
func (h *Handler) Handle(ctx context.Context, ev events.SQSEvent) (events.SQSEventResponse, error) {
	for _, r := range ev.Records {
		if r.MessageId == "" {
			return events.SQSEventResponse{}, errors.New("inbox: SQS record without a message id; failing the whole batch")
		}
	}
	b := &sqsBatch{m: inbox.BatchMetrics{Consumer: h.cfg.Consumer, Records: len(ev.Records), Failures: map[string]int{}}}
	recs := make([]*inbox.Record, len(ev.Records))
	h.mu.Lock()
	for i := range ev.Records {
		r := &ev.Records[i]
		n, _ := strconv.Atoi(r.Attributes["ApproximateReceiveCount"])
		recs[i] = &inbox.Record{ID: r.MessageId, Group: r.Attributes["MessageGroupId"], Body: []byte(r.Body), Deliveries: n,
			LastDelivery: h.cfg.MaxReceiveCount > 0 && n >= h.cfg.MaxReceiveCount, Handle: r}
		h.batches[recs[i]] = b
	}
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		for _, r := range recs {
			delete(h.batches, r)
		}
		h.mu.Unlock()
	}()
	err := h.e.Handle(ctx, sqsBroker{h: h, b: b}, recs)
	if h.cfg.OnBatch != nil {
		h.cfg.OnBatch(b.m)
	}
	if err != nil {
		return events.SQSEventResponse{}, err
	}
	return events.SQSEventResponse{BatchItemFailures: b.failed}, nil
}

// settled adds a settlement to its batch's metrics.
func (h *Handler) settled(s inbox.Settlement) {
	h.mu.Lock()
	b := h.batches[s.Record]
	h.mu.Unlock()
	if b != nil {
		b.mu.Lock()
		switch s.Action {
		case inbox.ActionApplied:
			b.m.Processed++
		case inbox.ActionDuplicate:
			b.m.Duplicates++
		default:
			b.m.Failures[s.Class]++
		}
		if !s.Envelope.OccurredAt.IsZero() {
			b.m.MaxLag = max(b.m.MaxLag, time.Since(s.Envelope.OccurredAt))
		}
		b.mu.Unlock()
	}
	if h.cfg.OnSettle != nil {
		h.cfg.OnSettle(s)
	}
}

// sqsBroker settles one Handle call's records: acknowledging is SQS's
// (it deletes what is not reported failed), retrying is reporting failed,
// dead-lettering is sending to the DLQ.
type sqsBroker struct {
	h *Handler
	b *sqsBatch
}

func (sqsBroker) Ack(context.Context, *inbox.Record) error { return nil }

func (s sqsBroker) Retry(_ context.Context, r *inbox.Record, _ inbox.Retry) error {
	s.b.mu.Lock()
	s.b.failed = append(s.b.failed, events.SQSBatchItemFailure{ItemIdentifier: r.ID})
	s.b.mu.Unlock()
	return nil
}

// DeadLetter sends r to the DLQ. If the DLQ refuses it, r is reported
// failed instead and comes back: its hold, committed already, makes the
// next receive dead-letter it again (the DLQ drops a copy by its message
// id), and in strict order the group's later records go behind it.
func (s sqsBroker) DeadLetter(ctx context.Context, r *inbox.Record, dl inbox.DeadLetter) error {
	if err := s.h.send(ctx, r.Handle.(*events.SQSMessage), r.Group, dl.Class, dl.Reason); err != nil {
		s.h.e.Config().Logger.Error("inbox: dead-letter failed; the record will be received again", "consumer", s.h.cfg.Consumer,
			"message_id", r.ID, "class", dl.Class, "error", err.Error())
		return s.Retry(ctx, r, inbox.Retry{})
	}
	return nil
}

// send puts r on the DLQ: same body and group, r's string attributes, and
// the fifobox_* diagnostics. The deduplication id is r's message id, so a
// record sent again (its batch failed to commit) is not duplicated.
func (h *Handler) send(ctx context.Context, r *events.SQSMessage, group, class, reason string) error {
	if group == "" {
		group = "fifobox-invalid"
	}
	str := func(s string) sqstypes.MessageAttributeValue {
		return sqstypes.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(s)}
	}
	attrs := map[string]sqstypes.MessageAttributeValue{
		AttrErrorClass:  str(class),
		AttrErrorReason: str(reason),
		AttrConsumer:    str(h.cfg.Consumer),
		AttrSourceQueue: str(orDash(r.EventSourceARN)),
	}
	// Keep the published attributes (filters, trace context) within SQS's
	// limit of 10 per message.
	names := make([]string, 0, len(r.MessageAttributes))
	for k := range r.MessageAttributes {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		v := r.MessageAttributes[k]
		if len(attrs) == 10 || v.StringValue == nil || strings.HasPrefix(k, "fifobox_") {
			continue
		}
		attrs[k] = sqstypes.MessageAttributeValue{DataType: aws.String(v.DataType), StringValue: v.StringValue}
	}
	body := r.Body
	if body == "" {
		body = "(empty body)"
	}
	_, err := h.dlq.SendMessage(ctx, &sqs.SendMessageInput{
		QueueUrl:               aws.String(h.cfg.DLQURL),
		MessageBody:            aws.String(body),
		MessageGroupId:         aws.String(group),
		MessageDeduplicationId: aws.String(r.MessageId),
		MessageAttributes:      attrs,
	})
	return err
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
