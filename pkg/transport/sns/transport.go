package sns

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/wire"
)

// The variables transport.Open reads for SNS/SQS.
const (
	EnvTopicARN        = "FIFOBOX_TOPIC_ARN"
	EnvQueues          = "FIFOBOX_QUEUES"
	EnvDLQURL          = "FIFOBOX_DLQ_URL"
	EnvConsumerOrder   = "FIFOBOX_CONSUMER_ORDER"
	EnvMaxReceiveCount = "FIFOBOX_MAX_RECEIVE_COUNT"
	EnvMaxRetries      = "FIFOBOX_MAX_RETRIES"
	EnvNamePrefix      = "FIFOBOX_SNS_NAME_PREFIX"
	EnvLogAggregateIDs = "FIFOBOX_LOG_AGGREGATE_IDS"
)

// Env declares every variable transport.Open reads for SNS/SQS (the AWS
// SDK reads the standard AWS_* ones itself). Each use needs its own: the
// dispatcher a topic, the consumer function its DLQ, the operator queues.
var Env = envspec.Set{
	{Name: EnvTopicARN, Doc: "the SNS FIFO topic's ARN (required to publish: the dispatcher)"},
	{Name: EnvQueues, Doc: `consumer queues as JSON {"<consumer>":{"queue_url":"...","dlq_url":"...","subscription_dlq_url":"..."}} (operations); unset: looked up by the topology's queue names`},
	{Name: EnvDLQURL, Doc: "the consumer queue's FIFO dead-letter queue URL (required by the consumer function)"},
	{Name: EnvConsumerOrder, Doc: "strict (default) or relaxed per-aggregate order after a dead-lettered event (consumer; default from the topology)"},
	{Name: EnvMaxReceiveCount, Doc: "the queue's maxReceiveCount, SQS's own dead-lettering: a backstop far above the retry budget (1-1000; consumer; default from the topology, 100)"},
	{Name: EnvMaxRetries, Doc: "the consumer's retry budget: how often an event's side effect may fail before it is dead-lettered; redeliveries that were not its failures do not count (1-50; consumer; default from the topology, 4)"},
	{Name: EnvNamePrefix, Doc: "prepended to the topic and queue names that provisioning creates and lookups find (side-by-side local runs and tests); default none"},
	{Name: EnvLogAggregateIDs, Doc: "true: consumers add aggregate ids to their logs (default false: they may carry personal data)"},
}

// localEnv is read only for a local run (transport.Options.Local).
var localEnv = envspec.Set{
	{Name: "AWS_ENDPOINT_URL", Doc: "the emulator, LocalStack or Floci (localstack/env.sh sets it)"},
}

// OpenEnv is every variable transport.Open reads for SNS/SQS: Env and the
// wire profile's (FIFOBOX_PROFILE).
var OpenEnv = envspec.Join(Env, wire.Env, inbox.TableEnv)

func init() {
	transport.Register(transport.SNS, transport.Opener{Env: OpenEnv, Open: open})
}

// Local runs (make local) provision short visibility timeouts and retry
// failed records after a second, so a failure comes back at once.
const (
	localVisibilityTimeoutSeconds = 30
	localRetryDelay               = time.Second
)

func open(ctx context.Context, o transport.Options) (transport.Transport, error) {
	cfg, err := ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	if o.Local {
		if localEnv.Get("AWS_ENDPOINT_URL") == "" {
			return nil, errors.New("AWS_ENDPOINT_URL is not set: source localstack/env.sh (make local does)")
		}
		cfg.VisibilityTimeoutSeconds, cfg.RetryDelay = localVisibilityTimeoutSeconds, localRetryDelay
	}
	awsCfg, err := awsclient.Load(ctx)
	if err != nil {
		return nil, err
	}
	cfg.SNS, cfg.SQS, cfg.Logger = awsclient.SNS(awsCfg), awsclient.SQS(awsCfg), o.Logger
	return New(cfg)
}

// Config is how fifobox reaches SNS and SQS and what it finds there.
type Config struct {
	// SNS and SQS are the clients (awsclient.SNS, awsclient.SQS). Required.
	SNS SNSAPI
	SQS SQSAPI
	// TopicARN is the SNS FIFO topic to publish to (FIFOBOX_TOPIC_ARN);
	// required to publish, unless Provision created it.
	TopicARN string
	// Queues locate each consumer's queues (FIFOBOX_QUEUES). Empty: they
	// are looked up by the topology's queue names (with NamePrefix).
	Queues Queues
	// Topology says what each consumer receives (subscription filters),
	// its order and maxReceiveCount, and what Provision creates. Default
	// topology.Default().
	Topology *topology.Topology
	// NamePrefix is prepended to the names Provision creates and lookups
	// find (FIFOBOX_SNS_NAME_PREFIX).
	NamePrefix string
	// VisibilityTimeoutSeconds overrides every provisioned queue's
	// visibility timeout. 0: the topology's.
	VisibilityTimeoutSeconds int
	// RetryDelay, if > 0, makes a runner's failed records visible again
	// after this long instead of the queue's visibility timeout.
	RetryDelay time.Duration
	// DLQURL is the consumer function's dead-letter queue
	// (FIFOBOX_DLQ_URL); required by LambdaHandler.
	DLQURL string
	// Order ("strict" or "relaxed", FIFOBOX_CONSUMER_ORDER) and
	// MaxReceiveCount (FIFOBOX_MAX_RECEIVE_COUNT) of the consumer function;
	// empty or 0: the topology's value for the consumer.
	Order           string
	MaxReceiveCount int
	// MaxRetries (FIFOBOX_MAX_RETRIES) is the consumer's retry budget: its
	// failures, counted per event (HandlerConfig.MaxRetries). 0: the
	// topology's (topology.Consumer.Retries).
	MaxRetries int
	// LogAggregateIDs adds aggregate ids to consumers' log lines
	// (FIFOBOX_LOG_AGGREGATE_IDS).
	LogAggregateIDs bool
	// Wire, if set, publishes every event as this wire profile renders it
	// (FIFOBOX_PROFILE, pkg/wire), and the profile's sns section is the
	// topology (its topic and subscriptions, raw or SNS-envelope delivery).
	Wire *wire.Mapper
	// Logger; default slog.Default().
	Logger *slog.Logger
}

// ConfigFromEnv reads Env (without the clients). A bad value is an error
// naming its variable.
func ConfigFromEnv() (Config, error) {
	c := Config{TopicARN: Env.Get(EnvTopicARN), DLQURL: Env.Get(EnvDLQURL), Order: Env.Get(EnvConsumerOrder), NamePrefix: Env.Get(EnvNamePrefix)}
	var err error
	if c.Queues, err = ParseQueues(Env.Get(EnvQueues)); err != nil {
		return c, err
	}
	if _, err := inbox.ParseOrder(c.Order); err != nil {
		return c, fmt.Errorf("%s: %w", EnvConsumerOrder, err)
	}
	if v := Env.Get(EnvMaxReceiveCount); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 1000 {
			return c, fmt.Errorf("%s=%q: want 1-1000 (the queue's maxReceiveCount)", EnvMaxReceiveCount, v)
		}
		c.MaxReceiveCount = n
	}
	if v := Env.Get(EnvMaxRetries); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 50 {
			return c, fmt.Errorf("%s=%q: want 1-50 (how often an event may fail before it is dead-lettered)", EnvMaxRetries, v)
		}
		c.MaxRetries = n
	}
	if c.MaxReceiveCount > 0 && c.MaxRetries >= c.MaxReceiveCount {
		return c, fmt.Errorf("%s=%d: must be below %s (%d): SQS would dead-letter an event before its retries are spent",
			EnvMaxRetries, c.MaxRetries, EnvMaxReceiveCount, c.MaxReceiveCount)
	}
	if v := Env.Get(EnvLogAggregateIDs); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return c, fmt.Errorf("%s=%q: want true or false", EnvLogAggregateIDs, v)
		}
		c.LogAggregateIDs = b
	}
	if c.Wire, err = wire.MapperFromEnv(wire.TransportSNS); err != nil {
		return c, err
	}
	return c, nil
}

// Transport is SNS FIFO / SQS FIFO as a transport.Transport: the SNS
// publisher, provisioning, the SQS consumer (a runner, and the Lambda
// handler for the SQS event source) and operations, sharing a config.
type Transport struct {
	cfg Config

	mu       sync.Mutex
	topicARN string // cfg.TopicARN, or what Provision created
	known    Queues // cfg.Queues, plus those provisioned or looked up
	pub      *Publisher
}

var (
	_ transport.Transport      = (*Transport)(nil)
	_ transport.LambdaConsumer = (*Transport)(nil)
)

// New returns a Transport for cfg; nothing is called until used.
func New(cfg Config) (*Transport, error) {
	switch {
	case cfg.SNS == nil || cfg.SQS == nil:
		return nil, errors.New("new sns transport: SNS and SQS clients are required")
	case cfg.VisibilityTimeoutSeconds < 0 || cfg.RetryDelay < 0:
		return nil, errors.New("new sns transport: VisibilityTimeoutSeconds and RetryDelay must not be negative")
	}
	if cfg.Topology == nil && cfg.Wire != nil {
		t := cfg.Wire.Profile().SNS.Topology()
		cfg.Topology = &t
	}
	if cfg.Topology == nil {
		t := topology.Default()
		cfg.Topology = &t
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	t := &Transport{cfg: cfg, topicARN: cfg.TopicARN, known: Queues{}}
	for n, q := range cfg.Queues {
		t.known[n] = q
	}
	return t, nil
}

// Kind is transport.SNS.
func (t *Transport) Kind() transport.Kind { return transport.SNS }

// String names the topic (once known) and the queues' source.
func (t *Transport) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	topic := t.topicARN
	if topic == "" {
		topic = "(no topic)"
	}
	return "SNS FIFO topic " + topic + ", SQS FIFO queues"
}

// Publisher returns the SNS FIFO publisher; it needs the topic
// (FIFOBOX_TOPIC_ARN, or Provision's).
func (t *Transport) Publisher() (transport.Publisher, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.pub != nil {
		return t.pub, nil
	}
	if t.topicARN == "" {
		return nil, fmt.Errorf("%s is required with %s=sns (the default): the SNS FIFO topic's ARN", EnvTopicARN, transport.EnvTransport)
	}
	p, err := NewPublisher(t.cfg.SNS, PublisherConfig{TopicARN: t.topicARN, Wire: t.cfg.Wire, Topology: t.cfg.Topology, Logger: t.cfg.Logger})
	if err != nil {
		return nil, err
	}
	t.pub = p
	return p, nil
}

// Provisioner returns the provisioner of the topology (Provision): the
// topic, each consumer's queue, DLQ and subscription with its DLQ. It is
// what make local and `fifobox provision` run against the emulator; in AWS
// the CDK app creates the same resources from the same definition. After
// it ran, the transport publishes to and consumes from what it created.
func (t *Transport) Provisioner() (transport.Provisioner, error) { return provisioner{t}, nil }

type provisioner struct{ t *Transport }

func (p provisioner) Provision(ctx context.Context) error {
	t := p.t
	res, err := Provision(ctx, t.cfg.SNS, t.cfg.SQS, *t.cfg.Topology,
		ProvisionOptions{Prefix: t.cfg.NamePrefix, VisibilityTimeoutSeconds: t.cfg.VisibilityTimeoutSeconds})
	if err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.topicARN == "" {
		t.topicARN = res.TopicARN
	}
	for n, q := range res.Queues {
		if _, ok := t.known[n]; !ok {
			t.known[n] = QueueURLs{QueueURL: q.URL, DLQURL: q.DLQURL, SubscriptionDLQURL: q.SubDLQURL}
		}
	}
	return nil
}

// Operations returns the SQS operations.
func (t *Transport) Operations() (transport.Operations, error) { return &Operations{t: t}, nil }

// Consumer returns an SQS Runner for the named consumer: the consumer
// function's handler fed by a local stand-in for Lambda's event source,
// with the topology's order and maxReceiveCount for the consumer.
func (t *Transport) Consumer(name string, db inbox.DB, apply inbox.Apply) (transport.Runner, error) {
	r, err := t.ConsumerWith(name, db, apply, inbox.ConsumerConfig{})
	if err != nil {
		return nil, err
	}
	return r, nil
}

// ConsumerWith is Consumer with the caller's OnSettle, DeadlineMargin,
// LogAggregateIDs and Logger (cc's other fields come from the topology).
func (t *Transport) ConsumerWith(name string, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (*Runner, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	q, err := t.queues(ctx, name)
	if err != nil {
		return nil, err
	}
	arn, err := t.queueARN(ctx, q.QueueURL)
	if err != nil {
		return nil, fmt.Errorf("consumer %s: %w", name, err)
	}
	log := cc.Logger
	if log == nil {
		log = t.cfg.Logger
	}
	h, err := t.handler(name, q.DLQURL, db, apply, transport.LambdaConfig{LogAggregateIDs: t.cfg.LogAggregateIDs || cc.LogAggregateIDs,
		Logger: log, DeadlineMargin: cc.DeadlineMargin}, cc.OnSettle)
	if err != nil {
		return nil, err
	}
	return &Runner{SQS: t.cfg.SQS, QueueURL: q.QueueURL, QueueARN: arn, Handler: h.Handle, RetryDelay: t.cfg.RetryDelay, Logger: t.cfg.Logger}, nil
}

// LambdaHandler returns the consumer function's SQS batch handler
// (transport.LambdaConsumer), dead-lettering to FIFOBOX_DLQ_URL, with one
// EMF metrics line per batch.
func (t *Transport) LambdaHandler(lc transport.LambdaConfig) (any, error) {
	if t.cfg.DLQURL == "" {
		return nil, fmt.Errorf("%s is required with %s=sns (the default)", EnvDLQURL, transport.EnvTransport)
	}
	h, err := t.handler(lc.Consumer, t.cfg.DLQURL, lc.DB, lc.Apply, lc, nil)
	if err != nil {
		return nil, err
	}
	return h.Handle, nil
}

// handler builds the SQS batch handler for consumer: order, retry budget
// and maxReceiveCount from the configuration, else the topology's.
func (t *Transport) handler(consumer, dlqURL string, db inbox.DB, apply inbox.Apply, lc transport.LambdaConfig, onSettle func(inbox.Settlement)) (*Handler, error) {
	order, maxReceive, retries := t.cfg.Order, t.cfg.MaxReceiveCount, t.cfg.MaxRetries
	if tc, ok := t.cfg.Topology.Consumer(consumer); ok {
		if order == "" {
			order = tc.OrderName()
		}
		if maxReceive == 0 {
			maxReceive = tc.ReceiveLimit()
		}
		if retries == 0 {
			tc.MaxReceiveCount = maxReceive
			retries = tc.Retries()
		}
	}
	o, err := inbox.ParseOrder(order)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", EnvConsumerOrder, err)
	}
	log := lc.Logger
	if log == nil {
		log = t.cfg.Logger
	}
	hc := HandlerConfig{Consumer: consumer, DLQURL: dlqURL, Order: o, MaxReceiveCount: maxReceive, MaxRetries: retries,
		DeadlineMargin: lc.DeadlineMargin, LogAggregateIDs: lc.LogAggregateIDs || t.cfg.LogAggregateIDs, Logger: log, OnSettle: onSettle}
	if hc.Inbox, err = inbox.TableFromEnv(); err != nil {
		return nil, err
	}
	if em := lc.Metrics; em != nil {
		hc.OnBatch = func(m inbox.BatchMetrics) {
			if err := em.InboxBatch(m); err != nil {
				log.Warn("emit consumer metrics failed", "error", err.Error())
			}
		}
	}
	h, err := NewHandler(db, t.cfg.SQS, apply, hc)
	if err != nil {
		return nil, fmt.Errorf("new consumer: %w", err)
	}
	return h, nil
}

// Close releases nothing: the AWS clients hold no connections of their own.
func (t *Transport) Close() error { return nil }

// consumerNames are the consumers operations report on by default: those
// of FIFOBOX_QUEUES, else the topology's.
func (t *Transport) consumerNames() []string {
	if len(t.cfg.Queues) > 0 {
		return t.cfg.Queues.Names()
	}
	var names []string
	for _, c := range t.cfg.Topology.Consumers {
		names = append(names, c.Name)
	}
	return names
}

// queues locates consumer's queues: FIFOBOX_QUEUES, what Provision
// created, or (when FIFOBOX_QUEUES is unset) the topology's queue names.
func (t *Transport) queues(ctx context.Context, consumer string) (QueueURLs, error) {
	if consumer == "" {
		return QueueURLs{}, errors.New("consumer is required")
	}
	t.mu.Lock()
	q, ok := t.known[consumer]
	t.mu.Unlock()
	if ok {
		return q, nil
	}
	if len(t.cfg.Queues) > 0 {
		return QueueURLs{}, fmt.Errorf("consumer %q has no queues in %s (known: %v)", consumer, EnvQueues, t.cfg.Queues.Names())
	}
	c, ok := t.cfg.Topology.Consumer(consumer)
	if !ok {
		return QueueURLs{}, fmt.Errorf("consumer %q is not in the topology; set %s", consumer, EnvQueues)
	}
	url := func(name string) (string, error) {
		out, err := t.cfg.SQS.GetQueueUrl(ctx, &sqs.GetQueueUrlInput{QueueName: aws.String(t.cfg.NamePrefix + name)})
		if err != nil {
			return "", fmt.Errorf("consumer %q: queue %s not found (%w); set %s", consumer, t.cfg.NamePrefix+name, err, EnvQueues)
		}
		return aws.ToString(out.QueueUrl), nil
	}
	var err error
	if q.QueueURL, err = url(c.QueueName()); err != nil {
		return q, err
	}
	if q.DLQURL, err = url(c.DLQName()); err != nil {
		return q, err
	}
	q.SubscriptionDLQURL, _ = url(c.SubscriptionDLQName()) // optional
	t.mu.Lock()
	t.known[consumer] = q
	t.mu.Unlock()
	return q, nil
}

func (t *Transport) queueARN(ctx context.Context, url string) (string, error) {
	out, err := t.cfg.SQS.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{QueueUrl: aws.String(url),
		AttributeNames: []sqstypes.QueueAttributeName{sqstypes.QueueAttributeNameQueueArn}})
	if err != nil {
		return "", fmt.Errorf("queue %s arn: %w", url, err)
	}
	return out.Attributes[string(sqstypes.QueueAttributeNameQueueArn)], nil
}
