// Package stacks holds fifobox's CDK stacks: the stateful network and database
// (StatefulStack), the messaging pipeline and its functions (StatelessStack),
// a Docker-emulator variant without VPC or Aurora (LocalStack), and the alarms
// and dashboard that both pipelines carry.
//
// The messaging layout (topic, queues, DLQs, filters, timeouts, concurrency)
// is not defined here: it comes from pkg/topology, the same definition the
// local bootstrapper reads.
package stacks

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-cdk-go/awscdk/v2/awslogs"
	"github.com/aws/constructs-go/constructs/v10"

	"github.com/fifobox/fifobox/pkg/topology"
)

// Metric names and dimensions emitted by the functions as CloudWatch EMF.
// They must match pkg/metrics/fifobox.go (infra does not import it to keep the
// application's database and SDK dependencies out of this module).
const (
	MetricsNamespace = "Fifobox"

	DimService        = "Service"
	DimConsumer       = "Consumer"
	ServiceDispatcher = "dispatcher"

	MetricOutboxBacklog           = "OutboxBacklog"
	MetricOldestPendingAgeSeconds = "OldestPendingAgeSeconds"
	MetricDeadEvents              = "DeadEvents"
	MetricParkedAggregates        = "ParkedAggregates"
	MetricDueEvents               = "OutboxDueEvents"
	MetricBackingOffEvents        = "OutboxBackingOffEvents"
	MetricParkedEvents            = "OutboxParkedEvents"
	MetricOldestDueAgeSeconds     = "OldestDueAgeSeconds"
	MetricRetryingAggregates      = "RetryingAggregates"
	MetricStrandedEvents          = "OutboxStrandedEvents"
	MetricPublished               = "Published"
	MetricRetries                 = "Retries"
	MetricProcessed               = "Processed"
	MetricDuplicates              = "Duplicates"
	MetricFailures                = "Failures"
	MetricConsumerLagSeconds      = "ConsumerLagSeconds"
)

// Function names, also the directories under the asset dir that hold each
// function's `bootstrap` (make build writes build/lambda/<name>/bootstrap).
const (
	FnDispatcher = "dispatcher"
	FnConsumer   = "consumer"
	FnRedrive    = "redrive"
)

// FunctionTag is the tag each function carries, valued with its bootstrap's
// name (FnDispatcher, FnConsumer, FnRedrive).
const FunctionTag = "fifobox:function"

// FunctionDBUsers are the database users the functions log in as through
// RDS Proxy (IAM), one per function, each a member of its role
// (migrations/00011_roles.sql). The migration function alone logs in as
// the master user (Config.DatabaseUser).
var FunctionDBUsers = map[string]string{
	FnDispatcher: "fifobox_dispatcher_fn",
	FnConsumer:   "fifobox_consumer_fn",
	FnRedrive:    "fifobox_operations_fn",
}

// DBPort is the PostgreSQL port of the cluster and of RDS Proxy.
const DBPort = 5432

// Thresholds are the alarm thresholds. An alarm fires when its metric is
// greater than the threshold (">" comparisons throughout).
type Thresholds struct {
	// PublishLagSeconds: the oldest due outbox event (publishable now: not
	// dead, parked or backing off) is older than this.
	PublishLagSeconds float64
	// DueBacklog: events due for publishing (OutboxDueEvents).
	DueBacklog float64
	// RetryingAggregates: aggregates whose head is backing off after a
	// retryable publish failure, for 5 minutes in a row.
	RetryingAggregates float64
	// BackingOffEvents: events waiting behind retrying heads.
	BackingOffEvents float64
	// DeadEvents: outbox rows that could not be published.
	DeadEvents float64
	// ParkedAggregates: aggregates whose later events wait behind a dead event.
	ParkedAggregates float64
	// ParkedEvents: events held behind dead heads, the dead ones included.
	ParkedEvents float64
	// StrandedEvents: events pending over 5 minutes that no claim reaches.
	StrandedEvents float64
	// ConsumerLagSeconds: now - occurred_at of the oldest event in a consumer batch.
	ConsumerLagSeconds float64
	// ConsumerFailures: failed records per consumer over 5 minutes.
	ConsumerFailures float64
	// QueueOldestMessageAgeSeconds: SQS ApproximateAgeOfOldestMessage of a consumer queue.
	QueueOldestMessageAgeSeconds float64
	// DLQVisibleMessages: messages waiting in a consumer's or a subscription's dead-letter queue.
	DLQVisibleMessages float64
	// DeliveryFailures: SNS NumberOfNotificationsFailed over 5 minutes.
	DeliveryFailures float64
	// DeliveryLost: SNS NumberOfNotificationsFailedToRedriveToDlq over 5 minutes.
	DeliveryLost float64
	// DispatcherErrors / DispatcherThrottles: Lambda Errors / Throttles of the dispatcher.
	DispatcherErrors    float64
	DispatcherThrottles float64
	// ConsumerErrors / ConsumerThrottles: Lambda Errors (a whole batch failed)
	// and Throttles of a consumer function.
	ConsumerErrors    float64
	ConsumerThrottles float64
	// ScheduleDLQVisibleMessages: scheduler invocations that could not be delivered.
	ScheduleDLQVisibleMessages float64
	// OperationsErrors: Lambda Errors of the operations (redrive) function.
	OperationsErrors float64
	// BrokerQueueReadyMessages: ready messages in a consumer's RabbitMQ
	// queue (Amazon MQ's MessageReadyCount), for 5 minutes in a row.
	BrokerQueueReadyMessages float64

	// OldestTransactionAgeSeconds: the oldest open transaction on the
	// database cluster (the dispatcher's gauge), for 3 minutes.
	OldestTransactionAgeSeconds float64
	// UnroutedEvents: events no consumer selects, in 5 minutes.
	UnroutedEvents float64
	// AuroraCPUPercent: the cluster's CPUUtilization, 15 minutes.
	AuroraCPUPercent float64
	// AuroraFreeableMemoryBytes: FreeableMemory below this, 15 minutes.
	AuroraFreeableMemoryBytes float64
	// AuroraConnectionsPercent: DatabaseConnections above this share of
	// the default max_connections at MaxCapacity, 10 minutes.
	AuroraConnectionsPercent float64
	// AuroraDeadlocks: Deadlocks (per second, maximum over 5 minutes).
	AuroraDeadlocks float64
	// AuroraFreeLocalStorageBytes: FreeLocalStorage below this.
	AuroraFreeLocalStorageBytes float64
	// AuroraTransactionIDs: MaximumUsedTransactionIDs (wraparound at 2^31).
	AuroraTransactionIDs float64
	// ProxyClientConnections: RDS Proxy ClientConnections, 10 minutes.
	ProxyClientConnections float64
	// ProxyPinnedSessions: DatabaseConnectionsCurrentlySessionPinned, 15 minutes.
	ProxyPinnedSessions float64
	// ProxyBorrowLatencyMicros: DatabaseConnectionsBorrowLatency (average), 15 minutes.
	ProxyBorrowLatencyMicros float64
	// BrokerMemoryPercent: a broker node's RabbitMQMemUsed as a share of
	// RabbitMQ's memory limit, 5 minutes.
	BrokerMemoryPercent float64
	// BrokerDiskFreePercent: a broker node's RabbitMQDiskFree below this
	// share of its volume, 5 minutes.
	BrokerDiskFreePercent float64
}

// DefaultThresholds are the shipped alarm thresholds.
func DefaultThresholds() Thresholds {
	return Thresholds{
		PublishLagSeconds:            60,
		DueBacklog:                   10000,
		RetryingAggregates:           0,
		BackingOffEvents:             1000,
		DeadEvents:                   0,
		ParkedAggregates:             0,
		ParkedEvents:                 1000,
		StrandedEvents:               0,
		ConsumerLagSeconds:           300,
		ConsumerFailures:             10,
		QueueOldestMessageAgeSeconds: 300,
		DLQVisibleMessages:           0,
		DeliveryFailures:             0,
		DeliveryLost:                 0,
		DispatcherErrors:             0,
		DispatcherThrottles:          0,
		ConsumerErrors:               0,
		ConsumerThrottles:            0,
		ScheduleDLQVisibleMessages:   0,
		OperationsErrors:             0,
		BrokerQueueReadyMessages:     1000,
		OldestTransactionAgeSeconds:  600,
		UnroutedEvents:               0,
		AuroraCPUPercent:             80,
		AuroraFreeableMemoryBytes:    256 << 20,
		AuroraConnectionsPercent:     80,
		AuroraDeadlocks:              0,
		AuroraFreeLocalStorageBytes:  1 << 30,
		AuroraTransactionIDs:         1e9,
		ProxyClientConnections:       1000,
		ProxyPinnedSessions:          0,
		ProxyBorrowLatencyMicros:     100000,
		BrokerMemoryPercent:          80,
		BrokerDiskFreePercent:        20,
	}
}

// ProxyAttributes identify an existing RDS Proxy (with IAM auth) to use
// instead of creating Aurora and a proxy.
type ProxyAttributes struct {
	Arn, Name, Endpoint, SecurityGroupID string
}

// Config is everything the stacks are parameterised by.
type Config struct {
	// Transport is where the dispatcher publishes: TransportSNS (default),
	// TransportRabbitMQ or TransportNATS, with AMQP or NATS below.
	Transport string
	AMQP      AMQPConfig
	NATS      NATSConfig

	// Prefix names the stacks (<Prefix>-Stateful, ...), alarms, dashboard and
	// key aliases; any prefix but the default also prefixes the topic and
	// queue names (see ResourceName), so a second deployment in one account
	// does not collide with the first.
	Prefix string
	// Topology is the messaging layout (pkg/topology).
	Topology topology.Topology
	// AssetDir holds <function>/bootstrap for each function.
	AssetDir string

	// DatabaseName and DatabaseUser: the database the functions use and the
	// user they authenticate as (IAM auth through RDS Proxy).
	DatabaseName string
	DatabaseUser string
	// DatabaseURL (local variant only) is passed as FIFOBOX_DATABASE_URL.
	DatabaseURL string

	// Aurora Serverless v2 capacity range in ACUs.
	MinCapacity, MaxCapacity float64
	// SecretRotationDays rotates the generated database secret.
	SecretRotationDays float64

	// Dispatcher function settings.
	DispatcherTimeoutSeconds      float64
	DispatcherReservedConcurrency float64
	DispatcherMemoryMB            float64
	// ConsumerMemoryMB applies to every consumer function.
	ConsumerMemoryMB float64
	// RedriveTimeoutSeconds bounds migrations and redrive operations.
	RedriveTimeoutSeconds float64
	// OutboxRetention and InboxRetention are what the daily prune keeps (Go
	// durations): sent outbox events, and inbox rows. InboxRetention must
	// outlast the DLQs' 14-day message retention, or a message redriven from
	// a DLQ after its inbox row is gone would be applied a second time.
	OutboxRetention, InboxRetention string

	// Thresholds for the alarms.
	Thresholds Thresholds
	// AlarmEmail, if set, is subscribed to the alarm topic.
	AlarmEmail string

	// VpcID, if set, uses an existing VPC (a context lookup: needs an AWS
	// account and region in the environment). SubnetGroupName then selects
	// the subnets for the functions and the database (default: the isolated
	// subnets); CreateEndpoints=false skips the interface endpoints if the
	// VPC already has them.
	VpcID           string
	SubnetGroupName string
	CreateEndpoints bool
	// ExistingProxy, if set, uses an existing RDS Proxy (and its database)
	// instead of creating Aurora Serverless v2 and a proxy.
	ExistingProxy *ProxyAttributes
}

// DefaultPrefix is Config.Prefix unless the context sets "prefix".
const DefaultPrefix = "Fifobox"

// ResourceName is the physical name of a topic or queue named name in the
// topology: unchanged for the default prefix (the names the CLI and the local
// demo look up), else "<lowercased prefix>-<name>".
func (c Config) ResourceName(name string) string {
	if c.Prefix == DefaultPrefix {
		return name
	}
	return strings.ToLower(c.Prefix) + "-" + name
}

// Namespace is the CloudWatch namespace the functions emit to and the alarms
// read: MetricsNamespace ("Fifobox") for the default prefix, else "Fifobox/<Prefix>",
// so two deployments in one account do not feed each other's alarms.
func (c Config) Namespace() string {
	if c.Prefix == DefaultPrefix {
		return MetricsNamespace
	}
	return MetricsNamespace + "/" + c.Prefix
}

// validPrefix: a CloudFormation stack name starts with a letter and holds
// letters, digits and hyphens; the same characters are valid in topic,
// queue, alarm and alias names.
var validPrefix = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9-]*$`)

// DefaultConfig is the configuration `cdk synth` uses without context.
func DefaultConfig() Config {
	return Config{
		Prefix:    DefaultPrefix,
		Transport: TransportSNS,
		AMQP: AMQPConfig{
			VirtualHost: "/", InstanceType: "mq.m5.large", DeploymentMode: "CLUSTER_MULTI_AZ",
			EngineVersion: "3.13", Username: "fifobox",
		},
		NATS:                          NATSConfig{Port: 4222},
		Topology:                      topology.Default(),
		AssetDir:                      "../build/lambda",
		DatabaseName:                  "fifobox",
		DatabaseUser:                  "fifobox",
		DatabaseURL:                   "postgres://postgres:postgres@host.docker.internal:5432/fifobox?sslmode=disable",
		MinCapacity:                   0.5,
		MaxCapacity:                   4,
		SecretRotationDays:            30,
		DispatcherTimeoutSeconds:      70,
		DispatcherReservedConcurrency: 2,
		DispatcherMemoryMB:            512,
		ConsumerMemoryMB:              256,
		RedriveTimeoutSeconds:         300,
		OutboxRetention:               "168h",
		InboxRetention:                "720h",
		Thresholds:                    DefaultThresholds(),
		CreateEndpoints:               true,
	}
}

// Validate checks the configuration before anything is synthesised.
func (c Config) Validate() error {
	if err := c.Topology.Validate(); err != nil {
		return fmt.Errorf("topology: %w", err)
	}
	if !validPrefix.MatchString(c.Prefix) {
		return fmt.Errorf("prefix %q: must start with a letter and hold only letters, digits and hyphens", c.Prefix)
	}
	if err := c.validateTransport(); err != nil {
		return err
	}
	// SQS caps queue names at 80 characters (".fifo" included).
	for _, cons := range c.Topology.Consumers {
		if c.Transport != TransportSNS {
			break
		}
		for _, q := range []string{cons.QueueName(), cons.DLQName(), cons.SubscriptionDLQName()} {
			if n := c.ResourceName(q); len(n) > 80 {
				return fmt.Errorf("prefix %q: queue name %s is %d characters, SQS allows 80", c.Prefix, n, len(n))
			}
		}
	}
	for _, fn := range []string{FnDispatcher, FnConsumer, FnRedrive} {
		p := filepath.Join(c.AssetDir, fn, "bootstrap")
		if _, err := os.Stat(p); err != nil {
			return fmt.Errorf("function %s: %s missing (run `make build` first): %w", fn, p, err)
		}
	}
	if c.DispatcherTimeoutSeconds < 1 || c.DispatcherTimeoutSeconds > 900 {
		return fmt.Errorf("dispatcher timeout %v s: must be 1-900", c.DispatcherTimeoutSeconds)
	}
	if c.DatabaseUser == "" || c.DatabaseName == "" {
		return fmt.Errorf("database name and user are required")
	}
	if d, err := time.ParseDuration(c.OutboxRetention); err != nil || d <= 0 {
		return fmt.Errorf("outbox retention %q: want a positive Go duration such as 168h", c.OutboxRetention)
	}
	if d, err := time.ParseDuration(c.InboxRetention); err != nil || d <= DLQRetentionDays*24*time.Hour {
		return fmt.Errorf("inbox retention %q: want a Go duration longer than the DLQs' %d-day retention, such as 720h", c.InboxRetention, DLQRetentionDays)
	}
	return nil
}

// LogRetention is how long every log group keeps its events: a year, what
// Control Tower's CT.CLOUDWATCH.PR.2 asks for (the functions log event ids
// and counts, not payloads, so a year of them costs little).
const LogRetention = awslogs.RetentionDays_ONE_YEAR

// DLQRetentionDays is how long the consumer DLQs keep a message (the SQS maximum).
const DLQRetentionDays = 14

// FromContext overrides cfg with the CDK context values (-c key=value or
// cdk.json "context"): prefix, assetDir, databaseName, databaseUser,
// databaseUrl, alarmEmail, vpcId, subnetGroupName, createEndpoints,
// outboxRetention, inboxRetention,
// dbProxyArn/dbProxyName/dbProxyEndpoint/dbProxySecurityGroupId,
// dispatcherReservedConcurrency, minCapacity, maxCapacity; transport
// (sns, rabbitmq, nats) with amqpTopology, amqpVirtualHost,
// amqpBrokerArn/amqpEndpoint/amqpSecretArn/amqpSecurityGroupId (an existing
// broker), amqpInstanceType, amqpDeploymentMode, amqpEngineVersion,
// amqpUsername (a new one), and natsTopology, natsUrl, natsSecretArn,
// natsDispatcherSecretArn, natsOperationsSecretArn, natsProvisionerSecretArn,
// natsCidr, natsPort.
func FromContext(node constructs.Node, cfg Config) (Config, error) {
	str := func(key string, dst *string) {
		if v := node.TryGetContext(&key); v != nil {
			*dst = fmt.Sprint(v)
		}
	}
	num := func(key string, dst *float64) error {
		v := node.TryGetContext(&key)
		if v == nil {
			return nil
		}
		f, err := strconv.ParseFloat(fmt.Sprint(v), 64)
		if err != nil {
			return fmt.Errorf("context %s=%v: not a number", key, v)
		}
		*dst = f
		return nil
	}
	str("prefix", &cfg.Prefix)
	str("assetDir", &cfg.AssetDir)
	str("databaseName", &cfg.DatabaseName)
	str("databaseUser", &cfg.DatabaseUser)
	str("databaseUrl", &cfg.DatabaseURL)
	str("alarmEmail", &cfg.AlarmEmail)
	str("vpcId", &cfg.VpcID)
	str("subnetGroupName", &cfg.SubnetGroupName)
	str("outboxRetention", &cfg.OutboxRetention)
	str("inboxRetention", &cfg.InboxRetention)
	str("transport", &cfg.Transport)
	cfg.Transport = strings.ToLower(cfg.Transport)
	for key, dst := range map[string]*string{
		"amqpTopology": &cfg.AMQP.TopologyFile, "amqpVirtualHost": &cfg.AMQP.VirtualHost,
		"amqpBrokerArn": &cfg.AMQP.BrokerArn, "amqpEndpoint": &cfg.AMQP.Endpoint,
		"amqpSecretArn": &cfg.AMQP.SecretArn, "amqpSecurityGroupId": &cfg.AMQP.SecurityGroupID,
		"amqpInstanceType": &cfg.AMQP.InstanceType, "amqpDeploymentMode": &cfg.AMQP.DeploymentMode,
		"amqpEngineVersion": &cfg.AMQP.EngineVersion, "amqpUsername": &cfg.AMQP.Username,
		"natsTopology": &cfg.NATS.TopologyFile, "natsUrl": &cfg.NATS.URL,
		"natsSecretArn": &cfg.NATS.SecretArn, "natsCidr": &cfg.NATS.CIDR,
	} {
		str(key, dst)
	}
	for key, ctx := range map[string]string{BrokerUserDispatcher: "natsDispatcherSecretArn", BrokerUserOperations: "natsOperationsSecretArn",
		BrokerUserProvisioner: "natsProvisionerSecretArn"} {
		var arn string
		str(ctx, &arn)
		if arn != "" {
			if cfg.NATS.SecretArns == nil {
				cfg.NATS.SecretArns = map[string]string{}
			}
			cfg.NATS.SecretArns[key] = arn
		}
	}
	if err := num("natsPort", &cfg.NATS.Port); err != nil {
		return cfg, err
	}
	var endpoints string
	str("createEndpoints", &endpoints)
	if endpoints != "" {
		cfg.CreateEndpoints = strings.EqualFold(endpoints, "true")
	}
	for key, dst := range map[string]*float64{
		"dispatcherReservedConcurrency": &cfg.DispatcherReservedConcurrency,
		"minCapacity":                   &cfg.MinCapacity,
		"maxCapacity":                   &cfg.MaxCapacity,
	} {
		if err := num(key, dst); err != nil {
			return cfg, err
		}
	}
	var p ProxyAttributes
	str("dbProxyArn", &p.Arn)
	str("dbProxyName", &p.Name)
	str("dbProxyEndpoint", &p.Endpoint)
	str("dbProxySecurityGroupId", &p.SecurityGroupID)
	if p != (ProxyAttributes{}) {
		if p.Arn == "" || p.Name == "" || p.Endpoint == "" || p.SecurityGroupID == "" {
			return cfg, fmt.Errorf("an existing proxy needs all of dbProxyArn, dbProxyName, dbProxyEndpoint, dbProxySecurityGroupId")
		}
		cfg.ExistingProxy = &p
	}
	return cfg, nil
}

// ContextBool reads a boolean context value ("true"/true).
func ContextBool(node constructs.Node, key string) bool {
	v := node.TryGetContext(&key)
	return v != nil && strings.EqualFold(fmt.Sprint(v), "true")
}
