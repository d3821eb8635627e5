package stacks

import (
	"fmt"

	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsec2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsiam"
	"github.com/aws/aws-cdk-go/awscdk/v2/awslogs"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsrds"
	"github.com/aws/constructs-go/constructs/v10"
	"github.com/aws/jsii-runtime-go"
	"github.com/cdklabs/cdk-nag-go/cdknag/v2"
)

// StatefulStack is the network and the database: things that hold state or
// take long to replace, deployed separately from the pipeline so that a
// pipeline change never touches them.
type StatefulStack struct {
	awscdk.Stack
	// Vpc and Subnets host the functions, the proxy and the database.
	Vpc     awsec2.IVpc
	Subnets *awsec2.SubnetSelection
	// FunctionSG is the security group of every function: it may reach the
	// proxy on 5432 and the interface endpoints on 443, nothing else.
	FunctionSG awsec2.ISecurityGroup
	// Proxy is the RDS Proxy the functions connect to (IAM auth, TLS).
	Proxy awsrds.IDatabaseProxy
	// Cluster is nil when an existing proxy is used.
	Cluster awsrds.DatabaseCluster
	// Broker is the RabbitMQ broker (transport rabbitmq only).
	Broker *AMQPBroker
}

// NewStatefulStack creates (or imports) the VPC, and creates Aurora
// Serverless v2 PostgreSQL behind RDS Proxy unless cfg.ExistingProxy is set.
func NewStatefulStack(scope constructs.Construct, id string, props *awscdk.StackProps, cfg Config) *StatefulStack {
	stack := awscdk.NewStack(scope, jsii.String(id), props)
	s := &StatefulStack{Stack: stack}

	s.Subnets = &awsec2.SubnetSelection{SubnetType: awsec2.SubnetType_PRIVATE_ISOLATED}
	if cfg.SubnetGroupName != "" {
		s.Subnets = &awsec2.SubnetSelection{SubnetGroupName: jsii.String(cfg.SubnetGroupName)}
	}

	if cfg.VpcID != "" {
		// Context lookup: needs CDK_DEFAULT_ACCOUNT/REGION (an AWS login) at synth
		// time; the result is cached in cdk.context.json.
		s.Vpc = awsec2.Vpc_FromLookup(stack, jsii.String("Vpc"), &awsec2.VpcLookupOptions{VpcId: jsii.String(cfg.VpcID)})
	} else {
		// A year of flow logs, encrypted (Control Tower's CT.CLOUDWATCH.PR.2/3):
		// they are the record of who talked to the database.
		flowLogs := awslogs.NewLogGroup(stack, jsii.String("VpcFlowLogs"), &awslogs.LogGroupProps{
			Retention:     LogRetention,
			EncryptionKey: newLogsKey(stack, "alias/"+cfg.Prefix+"-network-logs", "fifobox: VPC flow logs"),
			RemovalPolicy: awscdk.RemovalPolicy_DESTROY,
		})
		// Isolated subnets only: nothing here needs the internet. AWS APIs are
		// reached through interface endpoints; there is no NAT gateway to pay for.
		s.Vpc = awsec2.NewVpc(stack, jsii.String("Vpc"), &awsec2.VpcProps{
			MaxAzs:      jsii.Number(2),
			NatGateways: jsii.Number(0),
			SubnetConfiguration: &[]*awsec2.SubnetConfiguration{{
				Name: jsii.String("isolated"), SubnetType: awsec2.SubnetType_PRIVATE_ISOLATED, CidrMask: jsii.Number(24),
			}},
			FlowLogs: &map[string]*awsec2.FlowLogOptions{
				"all": {
					TrafficType: awsec2.FlowLogTrafficType_ALL,
					Destination: awsec2.FlowLogDestination_ToCloudWatchLogs(flowLogs, nil),
				},
			},
		})
		// The restrictDefaultSecurityGroup feature flag's provider.
		suppressGuardAt(stack, []string{"Custom::VpcRestrictDefaultSGCustomResourceProvider", "Handler"}, "lambda_inside_vpc_check",
			"CDK's provider that removes the default security group's rules. "+providerOutsideVpc)
	}

	// Endpoints the code in the VPC calls: SNS (dispatcher Publish), SQS
	// (consumer DLQ sends, redrive), Secrets Manager (the rotation function,
	// broker credentials).
	// Not needed: CloudWatch Logs (Lambda ships logs itself, EMF included),
	// STS (the execution role's credentials come with the invocation), RDS
	// (IAM auth tokens are signed locally), KMS (SNS/SQS call it server side).
	fnSG := awsec2.NewSecurityGroup(stack, jsii.String("FunctionSecurityGroup"), &awsec2.SecurityGroupProps{
		Vpc:              s.Vpc,
		Description:      jsii.String("fifobox functions: to RDS Proxy on 5432 and the VPC endpoints on 443 only"),
		AllowAllOutbound: jsii.Bool(false),
	})
	s.FunctionSG = fnSG

	// Which endpoints: SNS and SQS for the SNS transport; Lambda for
	// RabbitMQ (Amazon MQ event source pollers call it from the broker's
	// subnets); Secrets Manager always (rotation, broker credentials).
	type endpoint struct {
		id  string
		svc awsec2.InterfaceVpcEndpointAwsService
	}
	wanted := []endpoint{{"SecretsManagerEndpoint", awsec2.InterfaceVpcEndpointAwsService_SECRETS_MANAGER()}}
	switch cfg.Transport {
	case TransportSNS:
		wanted = append([]endpoint{
			{"SnsEndpoint", awsec2.InterfaceVpcEndpointAwsService_SNS()},
			{"SqsEndpoint", awsec2.InterfaceVpcEndpointAwsService_SQS()},
		}, wanted...)
	case TransportRabbitMQ:
		wanted = append(wanted, endpoint{"LambdaEndpoint", awsec2.InterfaceVpcEndpointAwsService_LAMBDA()})
	}
	var smEndpoint awsec2.IInterfaceVpcEndpoint
	var brokerEndpoints []awsec2.IInterfaceVpcEndpoint
	if cfg.CreateEndpoints {
		for _, e := range wanted {
			// Open=false: only the functions (and, for Secrets Manager, the
			// rotation function, which CDK allows itself) may use the endpoint,
			// not everything in the VPC's CIDR.
			ep := awsec2.NewInterfaceVpcEndpoint(stack, jsii.String(e.id), &awsec2.InterfaceVpcEndpointProps{
				Vpc: s.Vpc, Service: e.svc, Subnets: s.Subnets, PrivateDnsEnabled: jsii.Bool(true), Open: jsii.Bool(false),
			})
			if e.id != "LambdaEndpoint" { // the functions themselves never call Lambda
				ep.Connections().AllowDefaultPortFrom(fnSG, jsii.String("fifobox functions to "+e.id))
			}
			switch e.id {
			case "SecretsManagerEndpoint":
				smEndpoint = ep
				brokerEndpoints = append(brokerEndpoints, ep)
			case "LambdaEndpoint":
				brokerEndpoints = append(brokerEndpoints, ep)
			}
		}
	} else {
		// The VPC's own endpoints: allow HTTPS to the VPC's range.
		fnSG.AddEgressRule(awsec2.Peer_Ipv4(s.Vpc.VpcCidrBlock()), awsec2.Port_Tcp(jsii.Number(443)),
			jsii.String("HTTPS to the VPC interface endpoints"), nil)
	}
	switch cfg.Transport {
	case TransportRabbitMQ:
		s.Broker = newAMQPBroker(stack, s, cfg, brokerEndpoints)
	case TransportNATS:
		allowNATS(s, cfg)
	}

	var proxySG awsec2.ISecurityGroup
	if cfg.ExistingProxy != nil {
		p := cfg.ExistingProxy
		proxySG = awsec2.SecurityGroup_FromSecurityGroupId(stack, jsii.String("ProxySecurityGroup"), jsii.String(p.SecurityGroupID),
			&awsec2.SecurityGroupImportOptions{Mutable: jsii.Bool(true)})
		s.Proxy = awsrds.DatabaseProxy_FromDatabaseProxyAttributes(stack, jsii.String("Proxy"), &awsrds.DatabaseProxyAttributes{
			DbProxyArn: jsii.String(p.Arn), DbProxyName: jsii.String(p.Name), Endpoint: jsii.String(p.Endpoint),
			SecurityGroups: &[]awsec2.ISecurityGroup{proxySG},
		})
	} else {
		s.Cluster, s.Proxy, proxySG = newDatabase(stack, s, cfg, smEndpoint)
	}
	// RDS Proxy has no default port in CDK (AllowDefaultPortFrom panics): name it.
	// Adds ingress on the proxy's group and egress on the functions' group.
	proxySG.Connections().AllowFrom(fnSG, awsec2.Port_Tcp(jsii.Number(DBPort)), jsii.String("fifobox functions to RDS Proxy"))

	awscdk.NewCfnOutput(stack, jsii.String("ProxyEndpoint"), &awscdk.CfnOutputProps{Value: s.Proxy.Endpoint()})
	return s
}

func newDatabase(stack awscdk.Stack, s *StatefulStack, cfg Config, smEndpoint awsec2.IInterfaceVpcEndpoint) (awsrds.DatabaseCluster, awsrds.IDatabaseProxy, awsec2.ISecurityGroup) {
	cluster := awsrds.NewDatabaseCluster(stack, jsii.String("Database"), &awsrds.DatabaseClusterProps{
		Engine: awsrds.DatabaseClusterEngine_AuroraPostgres(&awsrds.AuroraPostgresClusterEngineProps{
			Version: awsrds.AuroraPostgresEngineVersion_VER_17_5(),
		}),
		// The generated secret is what RDS Proxy uses to reach the database;
		// clients authenticate to the proxy with IAM tokens as the same user.
		Credentials:             awsrds.Credentials_FromGeneratedSecret(jsii.String(cfg.DatabaseUser), nil),
		DefaultDatabaseName:     jsii.String(cfg.DatabaseName),
		Writer:                  awsrds.ClusterInstance_ServerlessV2(jsii.String("writer"), &awsrds.ServerlessV2ClusterInstanceProps{PubliclyAccessible: jsii.Bool(false)}),
		ServerlessV2MinCapacity: jsii.Number(cfg.MinCapacity),
		ServerlessV2MaxCapacity: jsii.Number(cfg.MaxCapacity),
		Vpc:                     s.Vpc,
		VpcSubnets:              s.Subnets,
		StorageEncrypted:        jsii.Bool(true),
		DeletionProtection:      jsii.Bool(true),
		IamAuthentication:       jsii.Bool(true),
		Backup:                  &awsrds.BackupProps{Retention: awscdk.Duration_Days(jsii.Number(7))},
		CloudwatchLogsExports:   jsii.Strings("postgresql"),
		CloudwatchLogsRetention: LogRetention,
		// Enhanced monitoring (Control Tower's CT.RDS.PR.? enhanced
		// monitoring control): OS metrics of the writer every minute, what
		// explains a slow claim when CPU or memory is the cause.
		MonitoringInterval: awscdk.Duration_Seconds(jsii.Number(60)),
		RemovalPolicy:      awscdk.RemovalPolicy_SNAPSHOT,
	})
	cdknag.NagSuppressions_AddResourceSuppressions(cluster, &[]*cdknag.NagPackSuppression{{
		Id:        jsii.String("AwsSolutions-IAM4"),
		Reason:    jsii.String("The enhanced-monitoring role RDS assumes uses AmazonRDSEnhancedMonitoringRole, the policy AWS documents for it: it writes only to the RDS* log groups (RDSOSMetrics)."),
		AppliesTo: &[]any{jsii.String("Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AmazonRDSEnhancedMonitoringRole")},
	}}, jsii.Bool(true))
	cluster.AddRotationSingleUser(&awsrds.RotationSingleUserOptions{
		AutomaticallyAfter: awscdk.Duration_Days(jsii.Number(cfg.SecretRotationDays)),
		Endpoint:           smEndpoint,
		VpcSubnets:         s.Subnets,
	})

	proxySG := awsec2.NewSecurityGroup(stack, jsii.String("ProxySecurityGroup"), &awsec2.SecurityGroupProps{
		Vpc:         s.Vpc,
		Description: jsii.String("RDS Proxy in front of the fifobox database"),
	})
	// End-to-end IAM: clients log in to the proxy with IAM tokens, and the
	// proxy logs in to the database with IAM as the same user. Each function
	// has its own database user (FunctionDBUsers, created with their roles
	// by migrations/00011_roles.sql, granted rds_iam there), so no password
	// exists for them anywhere. The master user's secret is not the proxy's:
	// only the migration function uses it, straight to the cluster.
	proxyRole := awsiam.NewRole(stack, jsii.String("ProxyRole"), &awsiam.RoleProps{
		AssumedBy:   awsiam.NewServicePrincipal(jsii.String("rds.amazonaws.com"), nil),
		Description: jsii.String("RDS Proxy: logs in to the fifobox database as the functions' users (end-to-end IAM)"),
	})
	var dbUserArns []*string
	for _, u := range FunctionDBUsers {
		dbUserArns = append(dbUserArns, jsii.String(fmt.Sprintf("arn:%s:rds-db:%s:%s:dbuser:%s/%s",
			*stack.Partition(), *stack.Region(), *stack.Account(), *cluster.ClusterResourceIdentifier(), u)))
	}
	proxyRole.AddToPolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
		Sid: jsii.String("ConnectAsFunctionUsers"), Actions: jsii.Strings("rds-db:connect"), Resources: &dbUserArns,
	}))
	proxy := awsrds.NewDatabaseProxy(stack, jsii.String("Proxy"), &awsrds.DatabaseProxyProps{
		ProxyTarget:       awsrds.ProxyTarget_FromCluster(cluster),
		DefaultAuthScheme: awsrds.DefaultAuthScheme_IAM_AUTH,
		Role:              proxyRole,
		Vpc:               s.Vpc,
		VpcSubnets:        s.Subnets,
		SecurityGroups:    &[]awsec2.ISecurityGroup{proxySG},
		IamAuth:           jsii.Bool(true),
		RequireTLS:        jsii.Bool(true),
		// Functions hold few connections each (pkg/db MaxConns 4); the rest of
		// the database's connections stay free for the service writing events.
		MaxConnectionsPercent: jsii.Number(50),
		DebugLogging:          jsii.Bool(false),
	})
	cluster.Connections().AllowDefaultPortFrom(proxySG, jsii.String("RDS Proxy to Aurora"))
	// The migration function logs in as the master user straight to the
	// cluster (its secret, password auth); the other functions could reach
	// the port too (one security group) but have no credentials for it.
	cluster.Connections().AllowDefaultPortFrom(s.FunctionSG, jsii.String("fifobox migration function to Aurora (master user)"))

	// CloudwatchLogsRetention is applied by CDK's LogRetention singleton function.
	suppressLogRetention(stack)
	suppressGuardAt(stack, []string{logRetentionPath}, "lambda_inside_vpc_check",
		"CDK's LogRetention provider (sets the retention of the Aurora log group RDS creates). "+providerOutsideVpc)
	return cluster, proxy, proxySG
}
