package stacks

import (
	"fmt"
	"math"

	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awscloudwatch"
	"github.com/aws/aws-cdk-go/awscdk/v2/awslogs"
	"github.com/aws/jsii-runtime-go"
)

// Alarm names of the stateful side (after "<Prefix>-"), and the outbox's
// unrouted-events and long-transaction alarms.
const (
	AlarmAuroraCPU            = "AuroraCPU"
	AlarmAuroraFreeableMemory = "AuroraFreeableMemory"
	AlarmAuroraConnections    = "AuroraConnections"
	AlarmAuroraDeadlocks      = "AuroraDeadlocks"
	AlarmAuroraLocalStorage   = "AuroraFreeLocalStorage"
	AlarmAuroraTransactionIDs = "AuroraTransactionIDs"
	AlarmProxyClientConns     = "ProxyClientConnections"
	AlarmProxyPinned          = "ProxyPinnedSessions"
	AlarmProxyBorrowLatency   = "ProxyBorrowLatency"
	AlarmBrokerMemory         = "BrokerMemory"
	AlarmBrokerDisk           = "BrokerDiskFree"
	AlarmOldestTransaction    = "OldestTransactionAge"
	AlarmUnroutedEvents       = "UnroutedEvents"
)

// MetricOldestTransactionAgeSeconds is the dispatcher's gauge of the oldest
// open transaction on the database cluster (pkg/metrics, Service=dispatcher).
const MetricOldestTransactionAgeSeconds = "OldestTransactionAgeSeconds"

// MetricUnroutedEvents counts the publishers' "fifobox: unrouted event" log
// lines (transport.UnroutedLogMessage): events no consumer selects.
const MetricUnroutedEvents = "UnroutedEvents"

// UnroutedLogMessage is pkg/transport's UnroutedLogMessage (infra does not
// import the application module).
const UnroutedLogMessage = "fifobox: unrouted event"

// auroraMaxConnections is Aurora PostgreSQL's default max_connections for a
// Serverless v2 cluster of maxACU: LEAST(memory/9531392, 5000), with 2 GiB
// per ACU.
func auroraMaxConnections(maxACU float64) float64 {
	return math.Min(math.Floor(maxACU*2*(1<<30)/9531392), 5000)
}

// brokerMemoryGiB is the memory of Amazon MQ for RabbitMQ instance types.
var brokerMemoryGiB = map[string]float64{
	"mq.t3.micro": 1, "mq.m7g.medium": 4,
	"mq.m5.large": 8, "mq.m5.xlarge": 16, "mq.m5.2xlarge": 32, "mq.m5.4xlarge": 64,
	"mq.m7g.large": 8, "mq.m7g.xlarge": 16, "mq.m7g.2xlarge": 32, "mq.m7g.4xlarge": 64,
	"mq.m7g.8xlarge": 128, "mq.m7g.12xlarge": 192, "mq.m7g.16xlarge": 256,
}

// brokerStorageGiB is the broker's volume: 20 GiB on mq.t3.micro, 200 GiB otherwise.
func brokerStorageGiB(instanceType string) float64 {
	if instanceType == "mq.t3.micro" {
		return 20
	}
	return 200
}

// rdsMetric is an AWS/RDS metric with one dimension.
func rdsMetric(name, dim string, value *string, stat string, periodMinutes float64) awscloudwatch.Metric {
	return awscloudwatch.NewMetric(&awscloudwatch.MetricProps{
		Namespace: jsii.String("AWS/RDS"), MetricName: jsii.String(name),
		DimensionsMap: &map[string]*string{dim: value},
		Statistic:     jsii.String(stat), Period: awscdk.Duration_Minutes(jsii.Number(periodMinutes)),
	})
}

// brokerNodeQuery is a Metrics Insights query over the broker's nodes (the
// node metrics carry a Node dimension whose values are known only once the
// broker runs): fn (MAX or MIN) of metric across them.
func brokerNodeQuery(p *Pipeline, fn, metric string, label string) awscloudwatch.MathExpression {
	return awscloudwatch.NewMathExpression(&awscloudwatch.MathExpressionProps{
		Expression: awscdk.Fn_Join(jsii.String(""), jsii.Strings(
			fmt.Sprintf(`SELECT %s(%s) FROM SCHEMA("AWS/AmazonMQ", Broker, Node) WHERE Broker = '`, fn, metric), *p.BrokerName, "'")),
		Label:  jsii.String(label),
		Period: awscdk.Duration_Minutes(jsii.Number(1)),
	})
}

// statefulAlarms are the database's, the proxy's and the broker's alarms,
// and the outbox's long-transaction and unrouted-events alarms.
func statefulAlarms(stack awscdk.Stack, cfg Config, p *Pipeline, net *Network) []alarmSpec {
	th := cfg.Thresholds
	var specs []alarmSpec

	// The dispatcher's gauge (pkg/metrics): missing data means the
	// dispatcher is not reporting, which the lag alarms cover.
	specs = append(specs, alarmSpec{name: AlarmOldestTransaction, description: fmt.Sprintf(
		"A transaction on the database cluster has been open longer than %.0f s: while it lasts, vacuum cannot remove the dead row versions the outbox leaves on every event (heads, counters, wake-ups) in any database of the cluster, and claims slow down; find it in pg_stat_activity (xact_start) and end it",
		th.OldestTransactionAgeSeconds),
		metric: dispatcherMetric(cfg, MetricOldestTransactionAgeSeconds, "Maximum", 60), threshold: th.OldestTransactionAgeSeconds,
		periods: 3, missing: awscloudwatch.TreatMissingData_NOT_BREACHING})

	// Events no consumer selects: counted from the dispatcher's log lines
	// (the unrouted policy delivers or sets them aside, never blocks).
	if p.Dispatcher != nil && p.Dispatcher.LogGroup() != nil {
		awslogs.NewMetricFilter(stack, jsii.String("UnroutedEventsFilter"), &awslogs.MetricFilterProps{
			LogGroup:        p.Dispatcher.LogGroup(),
			FilterPattern:   awslogs.FilterPattern_StringValue(jsii.String("$.msg"), jsii.String("="), jsii.String(UnroutedLogMessage)),
			MetricNamespace: jsii.String(cfg.Namespace()),
			MetricName:      jsii.String(MetricUnroutedEvents),
			MetricValue:     jsii.String("$.unrouted"),
			Unit:            awscloudwatch.Unit_COUNT,
		})
		specs = append(specs, alarmSpec{name: AlarmUnroutedEvents,
			description: "Events were published that no consumer selects (the topology's unrouted policy counted them delivered or set them aside in the catch-all): a new event type nobody subscribes to yet, or a consumer missing from the topology; the dispatcher's 'fifobox: unrouted event' log lines name them",
			metric: awscloudwatch.NewMetric(&awscloudwatch.MetricProps{
				Namespace: jsii.String(cfg.Namespace()), MetricName: jsii.String(MetricUnroutedEvents),
				Statistic: jsii.String("Sum"), Period: awscdk.Duration_Minutes(jsii.Number(5)),
			}), threshold: th.UnroutedEvents, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING})
	}

	if net == nil {
		return specs // the local variant has no database, proxy or broker of its own
	}
	if c := net.Cluster; c != nil {
		five := func(stat string) *awscloudwatch.MetricOptions {
			return &awscloudwatch.MetricOptions{Statistic: jsii.String(stat), Period: awscdk.Duration_Minutes(jsii.Number(5))}
		}
		maxConns := auroraMaxConnections(cfg.MaxCapacity)
		specs = append(specs,
			alarmSpec{name: AlarmAuroraCPU, description: fmt.Sprintf("Aurora's CPU is above %.0f %% for 15 minutes: at its maximum capacity (%.1f ACU) the cluster cannot scale further; claims and producers' transactions slow down", th.AuroraCPUPercent, cfg.MaxCapacity),
				metric: c.MetricCPUUtilization(five("Average")), threshold: th.AuroraCPUPercent, periods: 3, missing: awscloudwatch.TreatMissingData_BREACHING},
			alarmSpec{name: AlarmAuroraFreeableMemory, description: fmt.Sprintf("Aurora's freeable memory is below %.0f MiB for 15 minutes: the cluster is at its maximum capacity and will swap or evict its cache", th.AuroraFreeableMemoryBytes/(1<<20)),
				metric: c.MetricFreeableMemory(five("Minimum")), threshold: th.AuroraFreeableMemoryBytes, below: true, periods: 3, missing: awscloudwatch.TreatMissingData_BREACHING},
			alarmSpec{name: AlarmAuroraConnections, description: fmt.Sprintf("More than %.0f connections to Aurora for 10 minutes (%.0f %% of its default max_connections %.0f at %.1f ACU): new connections will soon be refused", th.AuroraConnectionsPercent*maxConns/100, th.AuroraConnectionsPercent, maxConns, cfg.MaxCapacity),
				metric: c.MetricDatabaseConnections(five("Maximum")), threshold: math.Floor(th.AuroraConnectionsPercent * maxConns / 100), periods: 2, missing: awscloudwatch.TreatMissingData_BREACHING},
			alarmSpec{name: AlarmAuroraDeadlocks, description: "Aurora reported deadlocks: fifobox's own statements take locks in one order and never deadlock; look at the producers' transactions (the server log names both sides)",
				metric: c.MetricDeadlocks(five("Maximum")), threshold: th.AuroraDeadlocks, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
			alarmSpec{name: AlarmAuroraLocalStorage, description: fmt.Sprintf("Aurora's free local storage (temporary files, sorts) is below %.0f GiB: queries that spill will fail", th.AuroraFreeLocalStorageBytes/(1<<30)),
				metric: c.MetricFreeLocalStorage(five("Minimum")), threshold: th.AuroraFreeLocalStorageBytes, below: true, periods: 1, missing: awscloudwatch.TreatMissingData_BREACHING},
			alarmSpec{name: AlarmAuroraTransactionIDs, description: fmt.Sprintf("The oldest unfrozen transaction id is %.0f million transactions old: vacuum is not keeping up (a long transaction, or autovacuum blocked); PostgreSQL stops writes near 2,000 million", th.AuroraTransactionIDs/1e6),
				metric: c.Metric(jsii.String("MaximumUsedTransactionIDs"), five("Maximum")), threshold: th.AuroraTransactionIDs, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
		)
		// No replica-lag alarm: the cluster has a writer only (add readers and
		// AuroraReplicaLagMaximum belongs here).
	}
	if net.Proxy != nil {
		name := net.Proxy.DbProxyName()
		specs = append(specs,
			alarmSpec{name: AlarmProxyClientConns, description: fmt.Sprintf("More than %.0f client connections to RDS Proxy for 10 minutes: a function or producer is leaking connections", th.ProxyClientConnections),
				metric: rdsMetric("ClientConnections", "ProxyName", name, "Maximum", 5), threshold: th.ProxyClientConnections, periods: 2, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
			alarmSpec{name: AlarmProxyPinned, description: "RDS Proxy has sessions pinned to a database connection for 15 minutes: something sets session state (SET, advisory locks, prepared statements, temporary tables), so the proxy cannot share that connection; fifobox's functions never pin",
				metric: rdsMetric("DatabaseConnectionsCurrentlySessionPinned", "ProxyName", name, "Maximum", 5), threshold: th.ProxyPinnedSessions, periods: 3, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
			alarmSpec{name: AlarmProxyBorrowLatency, description: fmt.Sprintf("RDS Proxy took more than %.0f ms on average to hand out a database connection for 15 minutes: its pool (MaxConnectionsPercent) is exhausted", th.ProxyBorrowLatencyMicros/1000),
				metric: rdsMetric("DatabaseConnectionsBorrowLatency", "ProxyName", name, "Average", 5), threshold: th.ProxyBorrowLatencyMicros, periods: 3, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
		)
	}
	if p.BrokerName != nil {
		it := cfg.AMQP.InstanceType
		if gib, ok := brokerMemoryGiB[it]; ok {
			// RabbitMQ blocks every publisher at its memory high watermark
			// (RabbitMQMemLimit, about 40 % of the instance's memory).
			limit := gib * (1 << 30) * 0.4
			specs = append(specs, alarmSpec{name: AlarmBrokerMemory, description: fmt.Sprintf(
				"A broker node uses more than %.0f %% of RabbitMQ's memory limit (about 40 %% of %s's %.0f GiB) for 5 minutes: at the limit RabbitMQ blocks every publisher (the dispatcher's publishes time out and retry); drain the queues or move to a larger instance", th.BrokerMemoryPercent, it, gib),
				metric: brokerNodeQuery(p, "MAX", "RabbitMQMemUsed", "largest memory use of a node"), threshold: math.Floor(limit * th.BrokerMemoryPercent / 100), periods: 5, missing: awscloudwatch.TreatMissingData_BREACHING})
		} else {
			awscdk.Annotations_Of(stack).AddWarningV2(jsii.String("fifobox:broker-memory-alarm"), jsii.String(
				"no broker memory alarm: instance type "+it+" has no known memory size (set amqpInstanceType)"))
		}
		free := brokerStorageGiB(it) * (1 << 30) * th.BrokerDiskFreePercent / 100
		specs = append(specs, alarmSpec{name: AlarmBrokerDisk, description: fmt.Sprintf(
			"A broker node has less than %.0f %% of its %.0f GiB volume free: at RabbitMQ's disk limit it blocks every publisher; consumers are behind (queue backlog alarms) or a DLQ keeps growing", th.BrokerDiskFreePercent, brokerStorageGiB(it)),
			metric: brokerNodeQuery(p, "MIN", "RabbitMQDiskFree", "smallest free disk of a node"), threshold: math.Floor(free), below: true, periods: 5, missing: awscloudwatch.TreatMissingData_BREACHING})
	}
	return specs
}
